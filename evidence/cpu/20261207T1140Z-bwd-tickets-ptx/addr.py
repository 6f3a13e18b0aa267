import re, sys
for f in sys.argv[1:]:
    s = open(f).read()
    # offsets of registers defined as base + const
    defs = {}
    for m in re.finditer(r"add\.s32 \t(%r\d+), (%r\d+), (\d+);", s):
        defs.setdefault(m.group(1), int(m.group(3)))
    inits = []
    for m in re.finditer(r"mbarrier\.init\.shared::cta\.b64 \[(%r\d+)\], (\d+);", s):
        inits.append((defs.get(m.group(1)), int(m.group(2))))
    # the spin's scratch: st.shared right after an acquire load
    spins = set()
    for m in re.finditer(r"ld\.global\.gpu\.acquire\.b32[^\n]*\n(?:[^\n]*\n){0,4}?[^\n]*st\.shared\.b32 \[ (%r\d+) \+ 0 \]", s):
        spins.add(defs.get(m.group(1)))
    loads = set(int(x) for x in re.findall(r"ld\.shared\.b32 \t%r\d+, \[global_smem\+(\d+)\]", s))
    print(f, "mbarriers (offset, count):", inits)
    print("   spin scratch offsets:", spins, "scalar smem loads:", loads)
    for off in spins:
        hit = [i for i in inits if i[0] is not None and i[0] <= off < i[0] + 8]
        print("   scratch", off, "overlaps mbarrier:", hit)
