"""Routing and admission policies, shared by the router and the fleet simulator."""
