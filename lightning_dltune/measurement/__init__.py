"""Measurement: the step timer and its windows (``measure``), the probe that reads every clock and counter
(``probe``), the GPU's timeline (``gpu``), NVML (``nvml``) and the resource budget (``budget``)."""
