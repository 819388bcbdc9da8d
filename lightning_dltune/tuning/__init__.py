"""The tuning core: the cost model (``model``), how configs compare (``compare``), when a window is judged
(``windows``), the decision's rules (``rules``), the diagnosis (``diagnose``), the workers' memory model (``memory``)
and the tuning state machine (``state``): pure Python, no torch, no clock, no I/O. ``agree`` holds the collectives
across ranks that carry their inputs and results."""
