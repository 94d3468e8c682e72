"""Tenants and SLO classes (`servelm serve --tenants FILE`): config, key lookup, per-tenant limits.

Plain Python over stdlib and yaml, usable by both HTTP fronts (server, router).
"""
