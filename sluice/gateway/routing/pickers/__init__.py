"""Pickers: the order in which a profile's candidates are tried (`plugins.Picker`)."""
