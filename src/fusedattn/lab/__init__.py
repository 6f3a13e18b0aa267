"""The lab: the chapter's experiments and the benchmarks, built on the library.

The registry of versions (`registry`, with the peers in `peers`), the input protocols, the
one verification (`verify`: poison, check, the tolerance table), the measurement protocol
(`protocol`, with `timing`), run-all and its worker processes, evidence and output folders,
the bench suites, profile (resources, Nsight Compute, compute-sanitizer), the walkthrough of
the online recurrence, and the figures. Imports run one way: the lab uses the library
(`fusedattn.api`, `reference`, `tiles`, `simt`), never the reverse.
"""
