"""Fill vLLM's model-info cache (``$VLLM_CACHE_ROOT/modelinfos``) for every
architecture AFD serves, native and role-split, in this one process.

vLLM inspects a model class it has not seen (interfaces, pooling, ...) in a
subprocess that imports vLLM again, once per class and machine, and caches
the result by the source file's hash: on a fresh machine each first start of
a family pays ~7 s more, twice (plain and AFD). The end-to-end session runs
this once instead (``python tests/e2e/warm_registry.py``): one import of
vLLM, then each class in turn, written as vLLM writes it. What a server then
reads is exactly what its own inspection would have written.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from vllm.model_executor.models import registry
from vllm.model_executor.models.registry import (
    ModelRegistry,
    _LazyRegisteredModel,
    _ModelInfo,
)

from vllm_afd.compat.engine_config import afd_model_classes
from vllm_afd.models.registry_table import missing_package


def _source(model: _LazyRegisteredModel) -> Path | None:
    prefix = "vllm.model_executor.models."
    if model.module_name.startswith(prefix):
        path = Path(registry.__file__).parent / f"{model.module_name[len(prefix) :]}.py"
        if path.exists():
            return path
    spec = importlib.util.find_spec(model.module_name)
    return Path(spec.origin) if spec is not None and spec.origin else None


def warm(model: _LazyRegisteredModel) -> bool:
    """Cache ``model``'s info unless it is cached; whether it was missing."""
    path = _source(model)
    if path is None:
        return False
    digest = model._get_modelinfo_module_hash(path)
    if model._load_modelinfo_from_cache(digest) is not None:
        return False
    try:
        cls = model.load_model_cls()
    except ModuleNotFoundError as e:
        lacks = missing_package(e)
        if lacks is None:
            raise
        # a module this host cannot import (Qwen3.5's needs torchvision):
        # plain vLLM cannot serve it here either
        print(f"{model.class_name}: not inspected, needs {lacks!r}")
        return False
    info = _ModelInfo.from_model_cls(cls)
    model._save_modelinfo_to_cache(info, digest)
    return True


def main() -> None:
    filled = 0
    for arch, target in afd_model_classes().items():
        native = ModelRegistry.models.get(arch)
        if isinstance(native, _LazyRegisteredModel):
            filled += warm(native)
        module, _, name = target.partition(":")
        filled += warm(_LazyRegisteredModel(module_name=module, class_name=name))
    print(f"vLLM model-info cache: {filled} class(es) inspected")


if __name__ == "__main__":
    main()
