"""DeepSpeed: the engine hooks (``engine.py``, also ``mechmon_megatron.deepspeed``), the monitors
built over an engine (``monitors.py``), the optimizer family's reads and probe (``optim.py``,
``zero3.py``).

Every import in the package is absolute, so ``import deepspeed`` inside these modules is the
real DeepSpeed, never this subpackage; DeepSpeed is imported lazily, inside functions.
"""
