"""Launcher configs: `python scripts/train.py --config=configs/gpt2.py:tiny`."""
