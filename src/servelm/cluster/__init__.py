"""`servelm cluster`: N replicas and a router from one config file (see spec.py, local.py)."""
