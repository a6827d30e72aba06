"""megatron-core, Megatron-LM and Megatron-Bridge.

``core*.py`` build the monitors over megatron-core model chunks (``core.attach``: custom loops
and the reference trainer); ``lm*.py`` hook Megatron-LM's training loop; ``bridge*.py`` are the
Megatron-Bridge callback; ``checkpoint.py`` keeps mechmon's state in their checkpoints;
``core_cpu.py`` and ``lm_cpu.py`` run megatron-core and Megatron-LM without CUDA. megatron is
imported lazily, inside functions.
"""
