"""Write a GGUF checkpoint as a Hugging Face folder, so another engine serves the same weights.

`sluice bench engine --compare vllm` gives vLLM the model Sluice serves. Sluice
dequantizes the GGUF (SmolLM2-135M-Instruct ships as Q4_1) to float32 and casts
to the engine dtype; this module writes exactly those values, cast to `dtype`,
as one `model.safetensors`, with:
* config.json: the loader's transformers-style config (gguf_loader.gguf_config)
  plus `torch_dtype`;
* tokenizer.json / tokenizer_config.json: the byte-level BPE tokenizer Sluice
  builds from the GGUF vocabulary, with its special tokens and chat template,
  so both engines see the same token ids for the same text;
* generation_config.json: the end-of-sequence ids (EOS, EOT, EOM) Sluice stops on.

The folder is written once under a cache directory keyed by the file's size and
mtime, to a temporary name renamed into place when complete: a run killed half
way leaves no folder that looks finished.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sluice" / "hf-export"


def export_dir_for(gguf_path: str, dtype: str, cache_dir: Path | None = None) -> Path:
    """Where the export of `gguf_path` lives: changes when the file does."""
    stat = os.stat(gguf_path)
    stem = Path(gguf_path).name.removesuffix(".gguf")
    return (cache_dir or default_cache_dir()) / f"{stem}-{dtype}-{stat.st_size}-{stat.st_mtime_ns}"


def ensure_hf_folder(gguf_path: str, dtype: str = "bfloat16",
                     cache_dir: Path | None = None) -> Path:
    """The HF folder of `gguf_path` in `dtype`, written now unless already there."""
    target = export_dir_for(gguf_path, dtype, cache_dir)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the export is a plain model folder
    try:
        write_hf_folder(gguf_path, tmp, dtype)
        try:
            tmp.rename(target)
        except OSError:  # another run finished the same export first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def write_hf_folder(gguf_path: str, out: Path, dtype: str = "bfloat16") -> None:
    import gguf
    from safetensors.torch import save_file

    from sluice.engine.gguf_loader import gguf_config, iter_gguf_tensors
    from sluice.gguf_tokenizer import gguf_byte_level_tokenizer

    reader = gguf.GGUFReader(gguf_path, "r")
    config = gguf_config(reader)
    tensors = {name: t[:].to(_DTYPES[dtype]).contiguous()
               for name, t in iter_gguf_tensors(reader, config)}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {k: v for k, v in config.items() if v is not None}
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype}, indent=2))

    tok, meta = gguf_byte_level_tokenizer(reader)
    tok.save(str(out / "tokenizer.json"))
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast",
                  "model_max_length": config["max_position_embeddings"],
                  "clean_up_tokenization_spaces": False, **meta["special_tokens"]}
    if meta["chat_template"]:
        tok_config["chat_template"] = meta["chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    generation = {"eos_token_id": sorted(meta["eos_ids"])}
    if meta["bos_token_id"] is not None:
        generation["bos_token_id"] = meta["bos_token_id"]
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
