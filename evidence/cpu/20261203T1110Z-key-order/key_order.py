import sys, importlib
order = sys.argv[1].split(",")
import fusedattn.hopper.forward_kernel as fk
import fusedattn.hopper.backward_kernel as bk
import fusedattn.tiles.flash_bwd, fusedattn.hopper.backward, fusedattn.api  # noqa
objs = {"fwd": fk._flash_fwd_sm90, "bwd": bk._flash_bwd_sm90, "steps": bk._steps, "masked": bk._masked_p, "keymask": bk._key_mask}
for name in order:
    objs[name].cache_key
print(sys.argv[1], "steps", bk._steps.cache_key[:12], "bwd", bk._flash_bwd_sm90.cache_key[:12])
