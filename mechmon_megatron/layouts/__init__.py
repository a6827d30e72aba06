"""Framework layouts: find a framework's modules on this rank and describe them as the sources
the monitors read (one module per framework and module kind, e.g. ``megatron_router``)."""
