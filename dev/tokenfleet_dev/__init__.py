"""Development tools that ship in no image: the embedded local control plane (``localcluster``),
the end-to-end demo and the benchmarks that need a control plane (``bench``)."""
