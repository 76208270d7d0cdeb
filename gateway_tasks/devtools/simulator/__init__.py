"""An OpenAI-compatible upstream simulator with TPM/RPM limits (``gateway simulate-upstream``)."""
