"""LoRA adapters served from the page pool: layout in pages, residency, and per-step stacks."""
