"""vLLM's LoRA limits, the one owner for the engine's flags and the operator's CRD (which
never imports the engine)."""

# vLLM's `--max-lora-rank` choices (its MaxLoRARanks); Sluice's engine takes the same flag.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
