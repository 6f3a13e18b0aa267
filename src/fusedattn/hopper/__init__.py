"""Hopper (sm90) kernels in Gluon (`triton.experimental.gluon`): warp-specialised, fed by TMA
through a ring of shared-memory stages and mbarriers, products on async wgmma. Gluon has no
interpreter, so these run on a Hopper GPU only; `fusedattn.dispatch` decides when they serve
a call and says why, and the portable `tiles/` kernels serve everything else."""
