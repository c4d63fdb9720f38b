"""Independence: whether outputs depend only on the inputs they should (batch, causal, documents,
padding): the check (``check``), the structures (``structures``) and the report (``report``).
"""
