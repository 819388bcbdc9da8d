"""The tuning core: the cost model (``model``), how configs compare (``compare``), when a window is judged
(``windows``), the decision's rules (``rules``), the diagnosis (``diagnose``) and the tuning state machine (``state``):
pure Python, no torch, no clock, no I/O. It reads measurement's values (``WindowStats``, ``Budget``, the workers'
memory model) and imports nothing that acts on a run; the collectives across ranks that carry its inputs and results
are :mod:`lightning_dltune.agreement`."""
