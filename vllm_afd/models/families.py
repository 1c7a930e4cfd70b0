"""What a model family adds to the generic role split: one small record each.

The split itself (:mod:`vllm_afd.models.split`) sits at vLLM's MoE boundary and
knows no family. A record names only what vLLM's model code does not say in a
form the split can read:

* ``dense_mlp``: the class, in the family's vLLM module, that builds the dense
  MLP layers and the shared experts (one class serves both in every family
  here; a shared expert is told apart by its prefix, nested inside the MoE
  block). None where the family has neither.
* ``attention``: the attention classes the FFN role does not build (a name
  in the family's module, or ``Class.attr`` where a block class holds its
  attention class as an attribute), and the family's own norm classes where
  it does not use vLLM's.
* ``gate``: the attribute of the MoE block that holds the router gate.
* ``gate_parts``: other attributes of the MoE block, as checkpoints name
  them, that belong to the router (loaded where the gate runs).
* ``layer_holds_moe``: the decoder layer holds the router and the experts
  itself, with no MoE block class around them (Gemma 4). The MoE block is
  then vLLM's MoE layer alone, the gate an attribute of the decoder layer,
  and the gate must run on attention (the FFN role cannot run a decoder
  layer).
* ``block_tail``: the MoE block changes what vLLM's MoE layer returned
  before it returns it (Cohere2-MoE averages the shared and routed outputs).
  With the gate on the FFN role, where the FFN runs the whole block, the FFN
  then returns what the MoE layer returned, and the block on attention
  finishes it, so the tail runs once.
* ``whole_expert_tensors``: the family's vLLM loader copies each checkpoint
  tensor that holds every expert (``[E, ...]``) whole into the experts'
  parameters, past vLLM's expert-id map (gpt-oss). An ``async`` FFN rank,
  which holds only its slice of the experts, then hands the loader the rows
  of its own experts.
* ``checkpoint_renames``: (checkpoint, vLLM) name parts that the family's
  loader maps itself, in its own code rather than a vLLM ``WeightsMapper``
  (Granite 4's router is ``router.layer`` in checkpoints, ``gate`` in vLLM):
  ownership is decided on the vLLM name.
* ``moe_modules``: other vLLM modules that build part of the family's model
  (a family reusing another's MoE block, or another family's model class),
  each with its dense-MLP class there; the FFN role builds no embedding,
  norm or lm_head of theirs either.

Records are keyed by the Hugging Face architecture name. An architecture with
no record is refused at start-up with the list of the supported ones.
"""

from __future__ import annotations

from dataclasses import dataclass


def vllm_module_path(module: str) -> str:
    """The import path of a vLLM model module as its registry names it
    (``qwen3_moe``, or an absolute ``vllm.…`` path)."""
    if module.startswith("vllm."):
        return module
    return f"vllm.model_executor.models.{module}"


@dataclass(frozen=True)
class Family:
    """One model family's record.

    Attributes:
        name: short family name (as ``vllm-afd tiny-model --arch`` spells it).
        module: the vLLM module, ``vllm.model_executor.models.<module>``.
        archs: Hugging Face architecture names served by this record.
        dense_mlp: class in ``module`` building dense MLPs and shared experts.
        attention: classes in ``module`` the FFN role replaces by nothing
            (attention, and norms of the family's own).
        gate: attribute of the MoE block holding the router gate.
        gate_parts: checkpoint names of router parts beside the gate in
            the MoE block (ERNIE-4.5's ``moe_statics``: its score bias).
        moe_modules: (module, dense-MLP class or None) of each other vLLM
            module whose classes build part of this family's model.
        layer_holds_moe: the decoder layer holds router and experts itself.
        block_tail: the MoE block changes its MoE layer's output.
        whole_expert_tensors: the loader copies all-expert tensors whole.
        checkpoint_renames: name parts the family's loader maps itself.
    """

    name: str
    module: str
    archs: tuple[str, ...]
    dense_mlp: str | None
    attention: tuple[str, ...]
    gate: str = "gate"
    gate_parts: tuple[str, ...] = ()
    moe_modules: tuple[tuple[str, str | None], ...] = ()
    layer_holds_moe: bool = False
    block_tail: bool = False
    whole_expert_tensors: bool = False
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    @property
    def module_path(self) -> str:
        return vllm_module_path(self.module)

    @property
    def builders(self) -> tuple[tuple[str, str | None], ...]:
        """(module path, dense-MLP class) of every module that builds MoE
        blocks or dense MLPs of this family, its own first."""
        return ((self.module_path, self.dense_mlp),) + tuple(
            (vllm_module_path(m), c) for m, c in self.moe_modules
        )


FAMILIES: tuple[Family, ...] = (
    Family(
        name="deepseek",
        module="deepseek_v2",
        # DeepSeek-MoE (``DeepseekForCausalLM``): the same classes with
        # multi-head attention (``DeepseekAttention``)
        archs=("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekForCausalLM"),
        dense_mlp="DeepseekV2MLP",
        attention=(
            "DeepseekV2MLAAttention",
            "DeepseekV2Attention",
            "DeepseekAttention",
        ),
    ),
    Family(
        name="qwen3_moe",
        module="qwen3_moe",
        archs=("Qwen3MoeForCausalLM",),
        dense_mlp="Qwen3MoeMLP",
        attention=("Qwen3MoeAttention",),
    ),
    Family(
        name="qwen2_moe",
        module="qwen2_moe",
        archs=("Qwen2MoeForCausalLM",),
        dense_mlp="Qwen2MoeMLP",
        attention=("Qwen2MoeAttention",),
    ),
    Family(
        name="mixtral",
        module="mixtral",
        archs=("MixtralForCausalLM",),
        dense_mlp=None,
        attention=("MixtralAttention",),
    ),
    Family(
        # Phi-MoE (Phi-3.5-MoE): Mixtral's layout with LayerNorm, attention
        # biases and top-2 routing by sparsemixer (vLLM's routing function,
        # carried by the router wherever the gate runs)
        name="phimoe",
        module="phimoe",
        archs=("PhiMoEForCausalLM",),
        dense_mlp=None,
        attention=("PhiMoEAttention",),
    ),
    Family(
        name="glm4_moe",
        module="glm4_moe",
        archs=("Glm4MoeForCausalLM",),
        dense_mlp="Glm4MoeMLP",
        attention=("Glm4MoeAttention",),
    ),
    Family(
        # GLM-4.7-Flash: DeepSeek's MLA with GLM-4.5's MoE block
        name="glm4_moe_lite",
        module="glm4_moe_lite",
        archs=("Glm4MoeLiteForCausalLM",),
        dense_mlp="Glm4MoeLiteMLP",
        attention=("Glm4MoeLiteAttention", "Glm4MoeLiteMLAAttention"),
        moe_modules=(("glm4_moe", "Glm4MoeMLP"),),
    ),
    Family(
        # A.X K1: DeepSeek-V3's layout in a module of its own
        name="axk1",
        module="AXK1",
        archs=("AXK1ForCausalLM",),
        dense_mlp="AXK1MLP",
        attention=("AXK1Attention", "AXK1MLAAttention"),
    ),
    Family(
        # Mistral Large 3: vLLM builds it with a subclass of DeepSeek-V3's
        # class (MLA, softmax grouped top-k, shared experts) that maps the
        # release's own weight names, so its classes are DeepSeek's
        name="mistral_large_3",
        module="deepseek_v2",
        archs=("MistralLarge3ForCausalLM",),
        dense_mlp="DeepseekV2MLP",
        attention=("DeepseekV2MLAAttention", "DeepseekV2Attention"),
    ),
    Family(
        # Ling and Ling 2.0: the router before the runner (Ling 2.0: sigmoid
        # scores with a bias held by the gate, grouped top-k), shared experts
        # and dense layers of one MLP class
        name="bailing_moe",
        module="bailing_moe",
        archs=("BailingMoeForCausalLM", "BailingMoeV2ForCausalLM"),
        dense_mlp="BailingMLP",
        attention=("BailingAttention",),
    ),
    Family(
        # Sarvam-MoE: vLLM builds it with a subclass of Ling's class (its
        # classes are Ling's: sigmoid top-k with a bias held by the gate,
        # routed scaling, a shared expert)
        name="sarvam_moe",
        module="bailing_moe",
        archs=("SarvamMoEForCausalLM",),
        dense_mlp="BailingMLP",
        attention=("BailingAttention",),
    ),
    Family(
        # Sarvam-MLA: DeepSeek-V3's layout in a module of its own (MLA,
        # sigmoid grouped top-k with a bias held by the gate, shared experts)
        name="sarvam_mla",
        module="sarvam",
        archs=("SarvamMLAForCausalLM",),
        dense_mlp="SarvamMLAMLP",
        attention=("SarvamMLAAttention",),
    ),
    Family(
        # Param2-MoE: a first dense layer and a shared expert (one MLP
        # class), sigmoid grouped top-k with a bias held by the gate
        name="param2moe",
        module="param2moe",
        archs=("Param2MoEForCausalLM",),
        dense_mlp="Param2MoEMLP",
        attention=("Param2MoEAttention",),
    ),
    Family(
        # openPangu Ultra MoE: MLA, sigmoid top-k with a score bias the gate
        # holds (its checkpoints store it on the MoE block, its loader renames
        # it in its own code), the routed scaling applied to the MoE output,
        # shared experts and dense layers of one MLP class. openPangu
        # Embedded: grouped-query attention, the same MoE block where its
        # config has routed experts. Pro MoE V2 (the same classes, sink
        # attention) has no record: plain vLLM fails on it
        name="openpangu",
        module="openpangu",
        archs=("PanguUltraMoEForCausalLM", "PanguEmbeddedForCausalLM"),
        dense_mlp="OpenPanguMLP",
        attention=(
            "OpenPanguMLAAttention",
            "OpenPanguEmbeddedAttention",
            "OpenPanguSinkAttention",
        ),
        checkpoint_renames=(
            (".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),
        ),
    ),
    Family(
        name="olmoe",
        module="olmoe",
        archs=("OlmoeForCausalLM",),
        dense_mlp=None,
        attention=("OlmoeAttention",),
    ),
    Family(
        name="granitemoe",
        module="granitemoe",
        archs=("GraniteMoeForCausalLM",),
        dense_mlp=None,
        attention=("GraniteMoeAttention",),
    ),
    Family(
        # sigmoid scores with a correction bias the MoE block holds itself
        # (loaded where the router runs); plain vLLM serves it on GPUs only
        name="minimax_m2",
        module="minimax_m2",
        archs=("MiniMaxM2ForCausalLM",),
        dense_mlp=None,
        attention=("MiniMaxM2Attention",),
        gate_parts=("e_score_correction_bias",),
    ),
    Family(
        name="ernie4_5_moe",
        module="ernie45_moe",
        archs=("Ernie4_5_MoeForCausalLM",),
        dense_mlp="Ernie4_5_MoeMLP",
        attention=("Ernie4_5_MoeAttention",),
        gate_parts=("moe_statics",),
    ),
    Family(
        # router outside the block (``router``), expert biases, clamped
        # SwiGLU; the decoder block holds its attention class as an attribute
        name="gpt_oss",
        module="gpt_oss",
        archs=("GptOssForCausalLM",),
        dense_mlp=None,
        attention=("TransformerBlock.attention_cls",),
        gate="router",
        whole_expert_tensors=True,
    ),
    Family(
        # Llama 4: router outside the runner, the routing weight applied to
        # the expert input, a shared expert; dense layers use Llama's MLP
        name="llama4",
        module="llama4",
        archs=("Llama4ForCausalLM",),
        dense_mlp="LlamaMLP",
        attention=("Llama4Attention",),
        gate="router",
        # the model, its embedding, final norm and lm_head come from Llama's
        moe_modules=(("llama", None),),
    ),
    Family(
        # Aria (multimodal, images served): Llama's decoder with an
        # MoE block in every layer, whose router weight the block holds as a
        # parameter (no gate module) and applies before the runner; shared
        # experts (Llama's MLP) passed into vLLM's MoE layer
        name="aria",
        module="aria",
        archs=("AriaForConditionalGeneration",),
        dense_mlp="LlamaMLP",
        # the vision tower and projector: the attention role's
        attention=("AriaVisionTransformer", "AriaProjector"),
        gate="router_weight",
        # the decoder, its attention, embedding and final norm are Llama's
        moe_modules=(("llama", None),),
    ),
    Family(
        # Granite-MoE's block with a shared MLP beside it in each layer
        name="granitemoeshared",
        module="granitemoeshared",
        # Granite-MoE-SWA: vLLM builds it with the same class (sliding windows
        # are the attention's, on the attention role)
        archs=("GraniteMoeSharedForCausalLM", "GraniteMoeSWAForCausalLM"),
        dense_mlp="GraniteMoeSharedMLP",
        attention=("GraniteMoeAttention",),
        moe_modules=(("granitemoe", None),),
    ),
    Family(
        # Granite 4: Mamba2 and attention layers (Mamba state on attention),
        # Granite-MoE's block with a shared MLP beside it in every layer
        name="granitemoehybrid",
        module="granitemoehybrid",
        archs=("GraniteMoeHybridForCausalLM",),
        dense_mlp="GraniteMoeSharedMLP",
        attention=("GraniteMoeHybridAttention", "MambaMixer2"),
        moe_modules=(("granitemoe", None),),
        # its loader maps these itself (no WeightsMapper)
        checkpoint_renames=(
            (".block_sparse_moe.router.layer.", ".block_sparse_moe.gate."),
            (".block_sparse_moe.input_linear.", ".block_sparse_moe.experts."),
            (".block_sparse_moe.output_linear.", ".block_sparse_moe.experts."),
        ),
    ),
    Family(
        # hybrid: gated delta-net linear attention (its state on attention)
        # and full attention; a shared expert with a sigmoid gate
        name="qwen3_next",
        module="qwen3_next",
        archs=("Qwen3NextForCausalLM",),
        dense_mlp="Qwen3NextMLP",
        attention=("Qwen3NextAttention", "QwenGatedDeltaNetAttention"),
    ),
    Family(
        # Qwen3.5-MoE (text): Qwen3-Next's MoE block and attention classes in
        # a decoder of its own; plain vLLM serves it on GPUs only
        name="qwen3_5_moe",
        module="qwen3_5",
        archs=("Qwen3_5MoeForCausalLM",),
        dense_mlp=None,
        attention=("Qwen3NextAttention", "QwenGatedDeltaNetAttention"),
        # the MoE block (its shared expert) is built in Qwen3-Next's module
        moe_modules=(("qwen3_next", "Qwen3NextMLP"),),
    ),
    Family(
        # a first dense layer and a shared expert (one MLP class), sigmoid
        # grouped top-k with a correction bias the MoE block holds itself
        name="exaone_moe",
        module="exaone_moe",
        # the second spelling is vLLM's alias of the same class
        archs=("ExaoneMoeForCausalLM", "ExaoneMoEForCausalLM"),
        dense_mlp="ExaoneMoeGatedMLP",
        attention=("ExaoneMoeAttention",),
        gate_parts=("e_score_correction_bias",),
    ),
    Family(
        # LayerNorm, a logit scale, a dense prefix and a shared expert (one
        # MLP class), the block averaging shared and routed outputs
        name="cohere2_moe",
        module="cohere2_moe",
        archs=("Cohere2MoeForCausalLM",),
        dense_mlp="Cohere2MoeMLP",
        # its norms are classes of its own (RMSNorm or Command-R's LayerNorm,
        # as the config says), not vLLM's layers
        attention=("Cohere2MoeAttention", "RMSNorm", "LayerNorm"),
        block_tail=True,
    ),
    Family(
        # no MoE block class: the decoder layer holds a dense MLP, a router
        # (its own norm, scales and routing function) and the experts
        name="gemma4",
        module="gemma4",
        archs=("Gemma4ForCausalLM",),
        dense_mlp="Gemma4MLP",
        attention=("Gemma4Attention",),
        gate="router",
        layer_holds_moe=True,
    ),
    Family(
        # MiMo-V2-Flash: sliding layers with attention sinks, a first dense
        # layer, sigmoid grouped top-k with a bias held by the gate
        name="mimo_v2",
        module="mimo_v2",
        archs=("MiMoV2FlashForCausalLM", "MiMoV2ForCausalLM"),
        dense_mlp="MiMoV2MLP",
        attention=("MiMoV2Attention",),
    ),
    Family(
        # Step-3.5: sigmoid scores with a bias the MoE block holds itself
        # (``router_bias``, loaded where the router runs), a shared expert
        # beside the routed ones, a per-head attention gate; plain vLLM
        # serves it on GPUs only
        name="step3p5",
        module="step3p5",
        archs=("Step3p5ForCausalLM",),
        dense_mlp="Step3p5MLP",
        attention=("Step3p5Attention",),
        gate_parts=("router_bias",),
    ),
    Family(
        # Step-3 (text): MQA with low-rank queries, softmax top-k, a shared
        # expert beside the MoE block in each MoE layer (built as the layer's
        # dense MLP), the dense layers of the same class
        name="step3_text",
        module="step3_text",
        archs=("Step3TextForCausalLM",),
        dense_mlp="Step3TextMLP",
        attention=("Step3TextAttention",),
    ),
    Family(
        # AFMoE (Arcee's Trinity): a first dense layer, a shared expert,
        # sigmoid grouped top-k with a bias the MoE block holds itself,
        # routed scaling; gated attention with q/k norms, sliding windows
        name="afmoe",
        module="afmoe",
        archs=("AfmoeForCausalLM",),
        dense_mlp="AfmoeMLP",
        attention=("AfmoeAttention",),
        gate_parts=("expert_bias",),
    ),
    Family(
        # HY-V3 (Hunyuan 3): a first dense layer, a shared expert, sigmoid
        # scores with a bias the MoE block holds itself, routed scaling
        name="hy_v3",
        module="hy_v3",
        archs=("HYV3ForCausalLM",),
        dense_mlp="HYV3FeedForward",
        attention=("HYV3Attention",),
        gate_parts=("expert_bias",),
    ),
)

_BY_ARCH = {arch: family for family in FAMILIES for arch in family.archs}

#: every architecture AFD serves, in table order
SUPPORTED_ARCHS: tuple[str, ...] = tuple(_BY_ARCH)


def family_of(arch: str) -> Family | None:
    """The record serving Hugging Face architecture ``arch``, or None."""
    return _BY_ARCH.get(arch)
