"""Framework-neutral math (torch only, no torch.distributed): exact spectra of low-rank products
(:mod:`mechmon_megatron.math.spectra`) and randomized sketches of implicit operators
(:mod:`mechmon_megatron.math.sketch`)."""
