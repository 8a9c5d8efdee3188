"""The live KV-memory dashboard of the meta-server: cluster_view.py builds the JSON,
http.py serves it and dashboard.html on meta_server.dashboard_port (0 = off)."""
