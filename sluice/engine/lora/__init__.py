"""Multi-LoRA serving: PEFT adapters on the base model, several in one batch (punica's
SGMV semantics), kept in an LRU of loaded adapters and a fixed number of batch slots."""
