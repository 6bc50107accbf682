"""Engine command lines: the flags of `sluice engine` (docs/contracts.md) or `vllm serve`.

Both engines publish KV events on 5557 (replay on 5558) with the llm-d topic
`kv@<pod-ip>:8000@<model>`, and serve `/health` and `/metrics` on 8000. `$(POD_IP)`
is expanded by the kubelet from the container's env.
"""

from __future__ import annotations

import json
import posixpath

from sluice.labels import HTTP_PORT, KV_EVENTS_PORT, KV_REPLAY_PORT, KV_TRANSFER_PORT
from sluice.operator import tensor_parallel
from sluice.operator.sources import HuggingFaceSource, ImageSource, PvcSource
from sluice.operator.spec import DECODE, PREFILL, PoolSpec, Resources

MODEL_CACHE_DIR = "/model-cache"
PVC_MOUNT_DIR = "/models"
HF_HOME = f"{MODEL_CACHE_DIR}/hf"


def kv_topic(model_name: str) -> str:
    return f"kv@$(POD_IP):{HTTP_PORT}@{model_name}"


def hf_download_dir(source: HuggingFaceSource) -> str:
    revision = source.revision or "main"
    return f"{MODEL_CACHE_DIR}/models/{source.repo.replace('/', '--')}@{revision}"


def model_argument(pool: PoolSpec) -> str:
    """What `--model` (sluice) or the positional model (vllm) is."""
    src = pool.source
    if src is None:
        return "default"
    if isinstance(src, PvcSource):
        return posixpath.join(PVC_MOUNT_DIR, src.path) if src.path else PVC_MOUNT_DIR
    if isinstance(src, ImageSource):
        return src.path
    assert isinstance(src, HuggingFaceSource)
    # vLLM downloads by itself into HF_HOME; the sluice engine loads a folder that the
    # `fetch-model` init container downloaded.
    return src.repo if pool.engine.kind == "vllm" else hf_download_dir(src)


def sluice_args(pool: PoolSpec, resources: Resources) -> list[str]:
    e = pool.engine
    args = [
        "engine", "--model", model_argument(pool), "--served-model-name", pool.model_name,
        "--host", "0.0.0.0", "--port", str(HTTP_PORT), "--dtype", e.dtype,
        "--block-size", str(e.block_size), "--max-num-seqs", str(e.max_num_seqs),
        "--max-num-batched-tokens", str(e.max_num_batched_tokens),
        "--kv-events-endpoint", f"tcp://*:{KV_EVENTS_PORT}",
        "--kv-events-replay-endpoint", f"tcp://*:{KV_REPLAY_PORT}",
        "--kv-events-topic", kv_topic(pool.model_name),
    ]
    if e.max_model_len:
        args += ["--max-model-len", str(e.max_model_len)]
    if e.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", str(e.gpu_memory_utilization)]
    if e.kv_cache_memory:
        args += ["--kv-cache-memory", e.kv_cache_memory]
    if not e.prefix_caching:
        args.append("--no-prefix-caching")
    return args + quantization_args(pool) + tensor_parallel_args(pool, resources) + list(e.args)


def vllm_args(pool: PoolSpec, resources: Resources) -> list[str]:
    e = pool.engine
    kv_events = {
        "enable_kv_cache_events": True, "publisher": "zmq",
        "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
        "replay_endpoint": f"tcp://*:{KV_REPLAY_PORT}",
        "topic": kv_topic(pool.model_name),
    }
    args = [
        model_argument(pool), "--served-model-name", pool.model_name,
        "--host", "0.0.0.0", "--port", str(HTTP_PORT), "--dtype", e.dtype,
        "--block-size", str(e.block_size), "--max-num-seqs", str(e.max_num_seqs),
        "--max-num-batched-tokens", str(e.max_num_batched_tokens),
        "--enable-prefix-caching" if e.prefix_caching else "--no-enable-prefix-caching",
        "--prefix-caching-hash-algo", "sha256_cbor",
        "--kv-events-config", json.dumps(kv_events, separators=(",", ":")),
    ]
    if isinstance(pool.source, HuggingFaceSource) and pool.source.revision:
        args += ["--revision", pool.source.revision]
    if e.max_model_len:
        args += ["--max-model-len", str(e.max_model_len)]
    if e.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", str(e.gpu_memory_utilization)]
    return args + quantization_args(pool) + tensor_parallel_args(pool, resources) + list(e.args)


def quantization_args(pool: PoolSpec) -> list[str]:
    """`--quantization` and `--kv-cache-dtype` where the pool names them (both kinds)."""
    e = pool.engine
    args = ["--quantization", e.quantization] if e.quantization else []
    return args + (["--kv-cache-dtype", e.kv_cache_dtype] if e.kv_cache_dtype != "auto" else [])


def tensor_parallel_args(pool: PoolSpec, resources: Resources) -> list[str]:
    """`--tensor-parallel-size N` (both kinds), and on CPUs the sluice engine's per-rank
    `--num-threads` from the role's `resources`; none for one rank. Before
    spec.engine.args, whose flags win."""
    n = pool.engine.tensor_parallel_size
    if n == 1:
        return []
    threads = tensor_parallel.num_threads(pool, resources)
    return ["--tensor-parallel-size", str(n)] + (
        ["--num-threads", str(threads)] if threads is not None else [])


def kv_transfer_config(pool: PoolSpec, role: str, curve_dir: str | None = None) -> dict | None:
    """`--kv-transfer-config` of a prefill/decode pool's role (vLLM's JSON shape); None for
    pools that serve whole requests. Sluice engines: prefill engines produce (serve their
    blocks on KV_TRANSFER_PORT, advertised at the pod IP), decode engines consume (pull
    them when a request names a prefill engine: the picker's `x-prefiller-host-port`);
    `curve_dir`: the transfer sockets' CURVE keys there. (Only Sluice engines take roles:
    spec.VLLM_ROLES.)"""
    if not pool.disaggregated or role not in (PREFILL, DECODE):
        return None
    assert pool.engine.kind == "sluice", "roles are for Sluice engines (spec.from_body)"
    return {"kv_connector": "SluiceConnector",
            "kv_role": "kv_producer" if role == PREFILL else "kv_consumer",
            "kv_ip": "0.0.0.0", "kv_port": KV_TRANSFER_PORT,
            "kv_connector_extra_config": {"advertise_host": "$(POD_IP)",
                                          **({"curve_dir": curve_dir} if curve_dir else {})}}


def engine_command(pool: PoolSpec, role: str = "",
                   transfer_curve_dir: str | None = None) -> tuple[list[str], list[str]]:
    """(command, args) of the engine container of `role` (`kv_transfer_config`'s curve_dir:
    `transfer_curve_dir`)."""
    resources = next((r for r in pool.roles if r.name == role), pool.roles[0]).resources
    command, args = ((["vllm", "serve"], vllm_args(pool, resources))
                     if pool.engine.kind == "vllm" else (["sluice"], sluice_args(pool, resources)))
    if pool.engine.speculative:
        args += ["--speculative-config",
                 json.dumps(dict(pool.engine.speculative), separators=(",", ":"))]
    transfer = kv_transfer_config(pool, role, transfer_curve_dir)
    if transfer is not None:
        args += ["--kv-transfer-config", json.dumps(transfer, separators=(",", ":"))]
    return command, args + lora_args(pool)


def lora_args(pool: PoolSpec) -> list[str]:
    """LoRA's flags, the same for both kinds. The adapters themselves are never flags
    (`--lora-modules`): the operator loads them into running engines (`lora.py`), so a
    changed list restarts none."""
    lora = pool.lora
    if lora is None:
        return []
    args = ["--enable-lora", "--max-loras", str(lora.max_loras),
            "--max-lora-rank", str(lora.max_lora_rank)]
    if lora.max_cpu_loras is not None:
        args += ["--max-cpu-loras", str(lora.max_cpu_loras)]
    return args


def fetch_model_script() -> str:
    """Init container program: download the HF snapshot (huggingface_hub ships with
    `tokenizers`, which every Sluice image has). Reads its inputs from env."""
    return (
        "import os; from huggingface_hub import snapshot_download; "
        "snapshot_download(os.environ['SLUICE_HF_REPO'], "
        "revision=os.environ.get('SLUICE_HF_REVISION') or None, "
        "local_dir=os.environ['SLUICE_MODEL_DIR'])"
    )
