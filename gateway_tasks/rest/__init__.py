"""The REST trigger (FastAPI): ``gateway api``."""
