import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

# The suite shares two cores with the engine processes it starts; one thread
# each avoids OpenMP oversubscription, which stalls every op.
torch.set_num_threads(1)

if not torch.cuda.is_available():  # Triton kernels run in Triton's interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """family -> folder of a tiny random HF model (llama, qwen2, qwen3)."""
    from hf_models import FAMILIES, save_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    return {f: save_tiny_model(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory) -> Path:
    """A tiny random Llama folder carrying SmolLM2's tokenizer and chat template."""
    from hf_models import save_tiny_chat_model

    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat") / "tiny-chat")
