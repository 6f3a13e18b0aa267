"""`python -m fusedattn_lab.profile target ...`: the process the profilers wrap."""

import sys

if len(sys.argv) > 1 and sys.argv[1] == "target":
    import fusedattn  # noqa: F401  (fix the mode first)
    from fusedattn_lab.profile.target import target_main

    raise SystemExit(target_main(sys.argv[2:]))
print("usage: python -m fusedattn_lab.profile target --version X --seq S --dim D --block B",
      file=sys.stderr)
raise SystemExit(2)
