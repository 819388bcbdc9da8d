"""What a run shows and keeps: the report (``report``), TensorBoard and the loggers (``view``), the picture (``plot``)
and the settled-config cache (``cache``)."""
