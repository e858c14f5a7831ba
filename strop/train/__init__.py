"""Supervised training roles: mid-training on code tokens and the SFT warm start."""
