"""Filters: which candidates a profile considers (`plugins.Filter`)."""
