"""Integrations of d3s.py into other trainers (each in its own module, with its own requirements).

integrations/trl.py   D3SGRPOConfig / D3SGRPOTrainer: D3S inside TRL's GRPOTrainer (requirements/trl.txt)
"""
