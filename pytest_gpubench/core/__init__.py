"""The ground floor: errors, files, the cache, secrets, signals, provenance, exit statuses."""
