"""Which files vLLM's loader reads for a model and load format, so that the weights'
identity (`weights.py`) hashes exactly those: vLLM's own selection, safetensors before
`.bin`, shards filtered by their index. Raises `WeightsError`, whose message names the
fix, where it cannot tell."""

from __future__ import annotations

import glob
import os

FIX = 'set kv_connector_extra_config["weights_id"] to name the checkpoint'
_DEFAULT_LOADER = ("auto", "hf", "safetensors", "fastsafetensors", "instanttensor",
                   "mistral", "pt", "npcache")


class WeightsError(Exception):
    """The weights cannot be named; the message says which file and the fix."""



def weights_dir(model_config, load_config) -> str | None:
    """The directory vLLM loads the weights from: a local path, or the Hugging Face
    snapshot in vLLM's `download_dir` (its default cache when unset). None if the
    snapshot is not on this machine yet."""
    path = getattr(model_config, "model_weights", "") or model_config.model
    if os.path.isdir(path):
        return path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, revision=model_config.revision,
                                 cache_dir=getattr(load_config, "download_dir", None),
                                 local_files_only=True)
    except Exception:  # noqa: BLE001 - not downloaded: vLLM will fetch it
        return None


def loaded_files(model_config, load_config) -> list[str]:
    """The weight files vLLM's loader reads for this model and load format, sorted."""
    fmt = str(getattr(load_config, "load_format", "auto")).lower()
    folder = weights_dir(model_config, load_config)
    if folder is None:
        raise WeightsError(f"the weights of {model_config.model!r} (revision "
                           f"{model_config.revision}) are not on this machine; {FIX}")
    if fmt in _DEFAULT_LOADER:
        fall_back_to_pt, overrides = _model_load_rules(model_config)
        files = _default_loader_files(folder, fmt, fall_back_to_pt, overrides)
    elif fmt == "sharded_state":  # vLLM's ShardedStateLoader: every rank's shards
        files = glob.glob(os.path.join(folder, "*.safetensors"))
    else:
        raise WeightsError(f"load_format {fmt!r}: gemma4-kv cannot tell which files vLLM "
                           f"loads; {FIX}")
    if not files:
        raise WeightsError(f"no weight file that load_format {fmt!r} reads in {folder}; "
                           f"{FIX}")
    return sorted(files)


def _model_load_rules(model_config) -> tuple[bool, list[str] | None]:
    """The model class's say in which files load (`fall_back_to_pt_during_load`,
    `allow_patterns_overrides`, as vLLM's DefaultModelLoader reads them)."""
    from vllm.model_executor.models.registry import ModelRegistry

    try:
        cls, _ = ModelRegistry.resolve_model_cls(model_config.architectures, model_config)
    except Exception as e:  # noqa: BLE001 - reported as the reason nothing is cached
        raise WeightsError(f"cannot resolve the model class of {model_config.model!r} "
                           f"({e}); {FIX}") from None
    return (getattr(cls, "fall_back_to_pt_during_load", True),
            getattr(cls, "allow_patterns_overrides", None))


def _default_loader_files(folder: str, load_format: str, fall_back_to_pt: bool,
                          overrides: list[str] | None) -> list[str]:
    """`DefaultModelLoader._prepare_weights` (vLLM 0.32) on a local folder, through
    vLLM's public filters: the first pattern with files wins, safetensors are filtered
    by their index, other formats lose the trainer's files."""
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME
    from vllm.model_executor.model_loader.weight_utils import (
        filter_duplicate_safetensors_files, filter_files_not_needed_for_inference)
    from vllm.transformers_utils.repo_utils import list_filtered_repo_files

    index_file = SAFE_WEIGHTS_INDEX_NAME
    use_safetensors = False
    if load_format == "auto":
        load_format = ("mistral" if list_filtered_repo_files(
            folder, allow_patterns=["consolidated*.safetensors"]) else "hf")
    if load_format == "hf":
        patterns = ["*.safetensors", "*.bin"]
    elif load_format in ("safetensors", "fastsafetensors", "instanttensor"):
        use_safetensors, patterns = True, ["*.safetensors"]
    elif load_format == "mistral":
        use_safetensors, patterns = True, ["consolidated*.safetensors"]
        index_file = "consolidated.safetensors.index.json"
    elif load_format == "pt":
        patterns = ["*.pt"]
    else:  # npcache
        patterns = ["*.bin"]
    if fall_back_to_pt and not use_safetensors:
        patterns += ["*.pt"]
    if overrides is not None:
        patterns = overrides
    files: list[str] = []
    for pattern in patterns:
        files += glob.glob(os.path.join(folder, pattern))
        if files:
            use_safetensors = use_safetensors or pattern.endswith(".safetensors")
            break
    if not use_safetensors:
        return filter_files_not_needed_for_inference(files)
    if overrides is not None:
        return files
    try:
        return filter_duplicate_safetensors_files(files, folder, index_file)
    except (OSError, ValueError, KeyError) as e:
        raise WeightsError(f"cannot read {os.path.join(folder, index_file)} ({e}); "
                           f"{FIX}") from None
