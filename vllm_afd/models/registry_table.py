"""Every MoE architecture in the installed vLLM's registry, and what AFD does
with it: the table in docs/models.md, generated here and held to the docs by
``tests/unit/test_models_table.py``.

An architecture counts as MoE when its vLLM module builds an MoE layer
(``FusedMoE`` appears in it) or imports a module that does (GLM-4.7-Flash
builds GLM-4.5's block). Served: a family record covers it
(:mod:`vllm_afd.models.families`). Every other one is refused at start-up,
naming the supported architectures; where it was tried, the reason is given.

    python -m vllm_afd.models.registry_table    # print the table
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import re
from pathlib import Path

from vllm_afd.models.families import family_of, vllm_module_path

#: what was found where an architecture was tried with a tiny checkpoint
TRIED: dict[str, str] = {
    "JambaForCausalLM": (
        "plain vLLM cannot serve it on CPU: its Mamba layers call a "
        "selective-scan kernel (`selective_scan_fwd`) the CPU build lacks; "
        "no record until it is tried on a GPU host"
    ),
    "LongcatFlashForCausalLM": (
        "plain vLLM cannot serve it on CPU: a tiny checkpoint with the "
        "release's config keys (`mla_scale_q_lora`, `mla_scale_kv_lora`, "
        "`zero_expert_type`, which transformers' `LongcatFlashConfig` does not "
        "write) and without weights for the zero-computation experts loads, "
        "and its first step fails in the zero-expert router, which calls a "
        "CUDA kernel the CPU build lacks (`'_moe_C' object has no attribute "
        "'topk_softmax'`); no record until it is tried on a GPU host"
    ),
    "Lfm2MoeForCausalLM": (
        "plain vLLM does not match transformers on a transformers-written "
        "checkpoint (`vllm-afd tiny-model --arch lfm2_moe`: for a 5-token "
        "prompt the first token's logprob is 0.0 in vLLM, the next below -36, "
        "and -1.6 in transformers); with a trial record (the short convolutions on "
        "attention) greedy ids were identical for 16 of 16 requests, but one "
        "request's logprobs differed from plain vLLM's by up to 9.5 at every "
        "step, the same in every run; no record until plain vLLM matches "
        "transformers on it"
    ),
    "DbrxForCausalLM": (
        "plain vLLM cannot load a DBRX checkpoint on any device: its loader "
        "maps the experts' `ffn.experts.mlp.{w1,v1,w2}` to "
        "`ffn.experts.w13_weight` and `w2_weight`, while vLLM's MoE factory "
        "holds them under `ffn.experts.routed_experts.`, so a tiny checkpoint "
        "in the release's names (`vllm-afd tiny-model --arch dbrx`) stops at "
        "load with `KeyError: 'blocks.0.ffn.experts.w13_weight'`; no record "
        "until plain vLLM loads it"
    ),
    "DeepseekV4ForCausalLM": (
        "plain vLLM cannot serve it on a CPU without AVX-512 BF16: its CPU "
        "module (`deepseek_v4/cpu`) calls kernels built only into that build "
        "of vLLM's `_C` (`convert_weight_packed`, `flash_mla_with_kvcache_cpu`, "
        "`hash_topk_cpu`, `hc_head`, ...), so loading a tiny checkpoint stops "
        "with `'_OpNamespace' '_C' object has no attribute "
        "'convert_weight_packed'`; and the split cannot serve its hash-routed "
        "MoE layers yet: they route by the input token ids (`tid2eid`), which "
        "the FFN role does not receive and the attention role's router call "
        "does not pass; not tried on a GPU"
    ),
    "DeepseekV4ForConditionalGeneration": (
        "vLLM's CPU build has only a stub of it (`deepseek_v4/vl_stub` raises "
        "`NotImplementedError`: CUDA or ROCm only); its text model is "
        "`DeepseekV4ForCausalLM`'s (above); not tried on a GPU"
    ),
    "LagunaForCausalLM": (
        "no record yet: its router's score bias is a parameter of vLLM's "
        "experts module (`mlp.experts.e_score_correction_bias`), which the "
        "attention role builds as a parameter-free stand-in, so routing there "
        "needs that parameter held by the stand-in first; and its sigmoid "
        "scores with a bias take the CPU router path plain vLLM fails on for "
        "MiniMax-M2, so it could be checked on a GPU only"
    ),
    "PanguProMoEV2ForCausalLM": (
        "plain vLLM cannot serve it on CPU: a tiny checkpoint with its sink "
        "attention (`param_sink_number`) fails at start-up in vLLM's KV-cache "
        "manager (`SinkFullAttentionManager.__init__() got an unexpected "
        "keyword argument 'needs_kv_cache_zeroing'`), and with the attention's "
        "q, k and v projections apart vLLM's loader fails before that (`This "
        "line should not be reached`: it hands the merged projection shard ids "
        "`q`, `k`, `v`); no record (the record `openpangu` serves Pangu Ultra "
        "MoE, which vLLM builds with the same classes); not tried on a GPU"
    ),
    "BailingMoeV3ForCausalLM": (
        "plain vLLM cannot serve it on CPU: a tiny config of its layout (MLA "
        "layers among Kimi Delta Attention layers by `layer_group_size`, "
        "model type `bailing_hybrid`) fails at start-up with "
        "`--mamba-block-size can only be set with --enable-prefix-caching` "
        "(vLLM aligns the KDA state's cache to prefix caching, then turns "
        "prefix caching off for MLA on CPU), and with "
        "`--no-enable-prefix-caching` with `Aligned KV cache block size 128 "
        "is not supported by attention backend(s): CPU_MLA` (vLLM's CPU MLA "
        "takes 16-token blocks only); its KDA layers run Triton kernels, "
        "which the CPU install lacks; no record; not tried on a GPU"
    ),
    "LongcatFlashNgramForCausalLM": (
        "plain vLLM cannot serve it on CPU: its module builds only under "
        "vLLM's model runner V2 (its n-gram embedding keeps each request's "
        "token history there), which needs Triton, which the CPU install "
        "lacks: a tiny config fails at start-up with `NotImplementedError: "
        "LongcatFlashNgramForCausalLM (LongCat-Flash-Lite) requires the V2 "
        "model runner for its n-gram embedding state` (vLLM falls back to the "
        "V1 runner), and with `VLLM_USE_V2_MODEL_RUNNER=1` with `Model Runner "
        "V2 requires Triton.`; LongCat-Flash itself has no record (above); "
        "not tried on a GPU"
    ),
    "NemotronHPuzzleForCausalLM": (
        "plain vLLM cannot serve it on CPU: vLLM builds it with Nemotron-H's "
        "class, whose routed experts are not gated (ReLU squared), and a tiny "
        "config (Mamba-2, MoE and attention layers, transformers' "
        "`NemotronHConfig`) stops while building its first MoE layer "
        "(`NotImplementedError: is_act_and_mul=False is supported only for "
        "CUDA, XPU and ROCm for now`); the split refuses Nemotron-H's latent "
        "MoE (`NemotronHForCausalLM`, above); no record; not tried on a GPU"
    ),
    "BailingMoeV2_5ForCausalLM": (
        "plain vLLM cannot serve it on CPU: a tiny config of its layout (MLA "
        "layers among linear-attention layers by `layer_group_size`, model "
        "type `bailing_hybrid`) fails at start-up with `--mamba-block-size "
        "can only be set with --enable-prefix-caching` (vLLM aligns the "
        "linear attention's state cache to prefix caching, then turns prefix "
        "caching off for MLA on CPU), and with `--no-enable-prefix-caching` "
        "with `Aligned KV cache block size 128 is not supported by attention "
        "backend(s): CPU_MLA` (vLLM's CPU MLA takes 16-token blocks only); "
        "its linear attention's decode kernel is a Triton kernel, which the "
        "CPU install lacks; no record; not tried on a GPU"
    ),
    "K2HorizonForCausalLM": (
        "plain vLLM cannot serve it on CPU: the attention of its MoE layers "
        "routes its value projection over experts (MoVA, `mova_num_experts`) "
        "through vLLM's Triton fused-MoE kernel "
        "(`dispatch_fused_moe_kernel`), which the CPU install lacks; a tiny "
        "config fails at its first forward before that, in `fused_mova_impl` "
        "(`IndexError: Dimension out of range (expected to be in range of "
        "[-2, 1], but got 2)`: the stacked value-expert weights are not 3-D "
        "on CPU); without MoVA, plain vLLM's CPU router fails on its sigmoid "
        'scores with a gate bias (`assert self.scoring_func == "softmax"`) '
        "and serves a tiny config routed by softmax without a bias; no record "
        "yet; not tried on a GPU"
    ),
    "NemotronHForCausalLM": (
        "latent MoE: projections into and out of the latent width run inside "
        "vLLM's MoE runner; refused while building (docs/models.md, Errors)"
    ),
}

#: served architectures plain vLLM serves on GPUs only, and where they are
#: checked instead
GPU_ONLY: dict[str, str] = {
    "MiniMaxM2ForCausalLM": (
        "on GPUs: plain vLLM's CPU router takes no sigmoid scores with a bias, "
        "so it is checked against plain vLLM on one GPU "
        "(`tests/gpu/test_families_gpu.py`)"
    ),
    "Qwen3_5MoeForCausalLM": (
        "on GPUs: vLLM's `qwen3_5` module imports its vision model, whose "
        "image processor needs torchvision, which the CPU install lacks (the "
        "CUDA builds pip brings break CPU torch), so it is checked against "
        "plain vLLM on one GPU (`tests/gpu/test_families_gpu.py`)"
    ),
    "GraniteMoeHybridForCausalLM": (
        "on GPUs: plain vLLM answers a short prompt on CPU but fails on "
        "longer ones, one sequence per step too (`IndexError` in "
        "`MambaMixer2.conv_ssm_forward`, its CPU Mamba2 path), so it is "
        "checked against plain vLLM on one GPU (`tests/gpu/test_families_gpu.py`)"
    ),
    "Step3p5ForCausalLM": (
        "on GPUs: plain vLLM loads it on CPU and fails at its first step: its "
        "CPU router takes softmax scores only without grouped top-k "
        '(`assert self.scoring_func == "softmax"`), and Step-3.5 scores with '
        "a sigmoid and a bias; on one GPU (`tests/gpu/test_families_gpu.py`) "
        "plain vLLM's own answers carried NaN logprobs (one H100), so it is "
        "served unchecked there"
    ),
}

#: vLLM modules the CPU install cannot import, and what they need that it
#: lacks (their vision or audio models' processors, CUDA kernels): plain
#: vLLM cannot load these architectures on CPU. Held to the installed vLLM by
#: ``tests/unit/test_models_table.py`` on a host without torchvision.
CPU_IMPORT_NEEDS: dict[str, str] = {
    **dict.fromkeys(
        (
            "bailing_moe_v3_vl",
            "cosmos3_edge",
            "gemma4_unified",
            "glm5next",
            "interns1_pro",
            "interns2_mobius",
            "interns2_preview",
            "mllama4",
            "mimo_v2_omni",
            "minicpmv4_6",
            "minicpmv4_7",
            "minimax_m3",
            "nano_nemotron_vl",
            "qwen3_asr",
            "qwen3_asr_realtime",
            "qwen3_omni_moe_thinker",
            "qwen3_vl_moe",
            "qwen3_5",
        ),
        "torchvision",
    ),  # fmt: skip
    # transformers' Gemma 4 processor, which needs torchvision
    "gemma4_mm": "`Gemma4Processor`",
    "diffusion_gemma": "`Gemma4Processor`",
    # vLLM's flash-attention package, whose kernels the CUDA build brings
    "dots3_note": "`vllm.vllm_flash_attn`",
}

_SECTIONS = ("_TEXT_GENERATION_MODELS", "_MULTIMODAL_MODELS")


def _imports(module: str) -> str:
    """A pattern of an import from ``module`` (relative or absolute)."""
    name = re.escape(module.rsplit(".", 1)[-1])
    return rf"(from \.|models\.){name} import"


def _spec(module: str) -> importlib.machinery.ModuleSpec | None:
    """Where a vLLM model module is, without importing it (None: nowhere)."""
    try:
        return importlib.util.find_spec(vllm_module_path(module))
    except (ImportError, ValueError):
        return None


def _source(module: str) -> str:
    """The source of a vLLM model module; of every file of a model package
    (``vllm.models.deepseek_v4`` keeps its MoE layers in submodules)."""
    spec = _spec(module)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return ""
    files = [Path(spec.origin)]
    if spec.submodule_search_locations:  # a package: all of it
        files = sorted(
            f for d in spec.submodule_search_locations for f in Path(d).rglob("*.py")
        )
    return "\n".join(f.read_text() for f in files)


def missing_package(error: ModuleNotFoundError) -> str | None:
    """The package outside vLLM that a failed import of a vLLM model module
    lacks (torchvision for Qwen3.5's), or None when vLLM itself lacks the
    module (vLLM moved: a caller must not take that for a host limit)."""
    if error.name is None or error.name.split(".")[0] == "vllm":
        return None
    return error.name


def _gpu_only_package(module: str) -> bool:
    """Whether a vLLM model package holds an implementation per GPU platform
    (an ``nvidia`` subpackage) and none for CPU (no ``cpu`` subpackage)."""
    spec = _spec(module)
    if spec is None or not spec.submodule_search_locations:
        return False
    dirs = [Path(d) for d in spec.submodule_search_locations]
    return any((d / "nvidia").is_dir() for d in dirs) and not any(
        (d / "cpu").is_dir() for d in dirs
    )


@functools.cache
def moe_architectures() -> tuple[tuple[str, str], ...]:
    """(architecture, vLLM module) of every MoE architecture in vLLM's text
    generation and multimodal registries, sorted by architecture (read once
    per process: the installed vLLM does not change under it)."""
    from vllm.model_executor.models import registry

    archs: dict[str, str] = {}
    for section in _SECTIONS:
        for arch, (module, _) in getattr(registry, section).items():
            archs[arch] = module
    sources = {m: _source(m) for m in set(archs.values())}
    moe = {m for m, text in sources.items() if "FusedMoE" in text}
    while True:  # modules that build another module's MoE block
        grown = {
            m
            for m, text in sources.items()
            if m not in moe
            and any(
                re.search(
                    rf"(from \.|models\.){re.escape(x.rsplit('.', 1)[-1])} import", text
                )
                for x in moe
            )
        }
        if not grown:
            break
        moe |= grown
    return tuple(sorted((a, m) for a, m in archs.items() if m in moe))


def _vllm_class(arch: str) -> str:
    """The class vLLM's registry builds ``arch`` with."""
    from vllm.model_executor.models.registry import _VLLM_MODELS

    return _VLLM_MODELS[arch][1]


def table_markdown() -> str:
    """The docs/models.md table of every MoE architecture."""
    rows = ["| Architecture | vLLM module | AFD |", "|---|---|---|"]
    for arch, module in moe_architectures():
        family = family_of(arch)
        if family is not None:
            what = f"served (record `{family.name}`)"
            built_as = _vllm_class(arch)
            if built_as != arch:
                what += f"; vLLM builds it with the class of `{built_as}`"
            if arch in GPU_ONLY:
                what += f"; {GPU_ONLY[arch]}"
        else:
            short = module.rsplit(".", 1)[-1]
            untried = "no family record (not tried)"
            if short in CPU_IMPORT_NEEDS:
                untried = (
                    f"no family record: vLLM's `{short}` module imports "
                    f"{CPU_IMPORT_NEEDS[short]}, which the CPU install lacks, so "
                    "plain vLLM cannot load it on CPU; not tried on a GPU"
                )
            elif _gpu_only_package(module):
                untried = (
                    f"no family record: vLLM implements it per platform "
                    f"(`{short}/nvidia`, ...) with no CPU implementation, so "
                    "plain vLLM cannot serve it on CPU; not tried on a GPU"
                )
            what = "refused at start-up: " + TRIED.get(arch, untried)
        rows.append(f"| `{arch}` | `{module.rsplit('.', 1)[-1]}` | {what} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(table_markdown(), end="")
