"""The tools: the ``dltune`` command (``cli``), the offline benchmark (``bench``), the demo (``demo``) and the synthetic
workloads the demo, tests and benchmarks use (``synthetic``)."""
