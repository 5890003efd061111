"""LoRA adapters at run time, unmerged: PEFT directories read and checked (adapter.py), the session's resident
slots (slots.py), and adapters by name with their LRU caches (manager.py). docs/lora.md."""
from .manager import LoraConfig, LoraManager

__all__ = ["LoraConfig", "LoraManager"]
