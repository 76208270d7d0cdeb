"""A pool's TPM/RPM bucket, upstream side: settle, sync, drain on 429, take (lua/bucket/)."""
