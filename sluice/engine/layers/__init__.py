"""The layers model files build from (vLLM's `model_executor/layers`): each picks its
kernel from the platform and dtype itself, at construction or once its weights are loaded."""
