"""Who may call what: mesh identity (cluster secret or mTLS), client API keys, the admin token, TLS files."""
