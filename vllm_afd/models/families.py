"""What a model family adds to the generic role split: one small record each.

The split itself (:mod:`vllm_afd.models.split`) sits at vLLM's MoE boundary and
knows no family. A record names only what vLLM's model code does not say in a
form the split can read:

* ``dense_mlp``: the class, in the family's vLLM module, that builds the dense
  MLP layers and the shared experts (one class serves both in every family
  here; a shared expert is told apart by its prefix, nested inside the MoE
  block). None where the family has neither.
* ``attention``: the attention classes the FFN role does not build.
* ``gate``: the attribute of the MoE block that holds the router gate.

Records are keyed by the Hugging Face architecture name. An architecture with
no record is refused at start-up with the list of the supported ones.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """One model family's record.

    Attributes:
        name: short family name (as ``vllm-afd tiny-model --arch`` spells it).
        module: the vLLM module, ``vllm.model_executor.models.<module>``.
        archs: Hugging Face architecture names served by this record.
        dense_mlp: class in ``module`` building dense MLPs and shared experts.
        attention: classes in ``module`` the FFN role replaces by nothing.
        gate: attribute of the MoE block holding the router gate.
    """

    name: str
    module: str
    archs: tuple[str, ...]
    dense_mlp: str | None
    attention: tuple[str, ...]
    gate: str = "gate"

    @property
    def module_path(self) -> str:
        return f"vllm.model_executor.models.{self.module}"


FAMILIES: tuple[Family, ...] = (
    Family(
        name="deepseek",
        module="deepseek_v2",
        archs=("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"),
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
        name="glm4_moe",
        module="glm4_moe",
        archs=("Glm4MoeForCausalLM",),
        dense_mlp="Glm4MoeMLP",
        attention=("Glm4MoeAttention",),
    ),
)

_BY_ARCH = {arch: family for family in FAMILIES for arch in family.archs}

#: every architecture AFD serves, in table order
SUPPORTED_ARCHS: tuple[str, ...] = tuple(_BY_ARCH)


def family_of(arch: str) -> Family | None:
    """The record serving Hugging Face architecture ``arch``, or None."""
    return _BY_ARCH.get(arch)
