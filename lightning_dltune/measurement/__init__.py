"""Measurement: the step timer and its windows (``measure``), the probe that reads every clock and counter
(``probe``), the GPU's timeline (``gpu``), NVML (``nvml``), the resource budget (``budget``) and the workers' memory
model fitted to what they hold (``memory``)."""
