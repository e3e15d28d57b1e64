"""Training data: RecordIO and other sources (``sources``), the Grain input pipeline (``pipeline``)."""
