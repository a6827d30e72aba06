"""Command-line launchers that run a framework's own training script under mechmon.

``python -m mechmon_megatron.launch.megatron pretrain_gpt.py --mechmon-config cfg.yaml <args>``
"""
