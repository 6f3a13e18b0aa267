"""Thin adapters from other libraries' attention hooks to `fusedattn.attention`; each one
holds that library's conventions and nothing else. Importing a module registers it."""
