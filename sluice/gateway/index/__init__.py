"""The prefix index: this replica's local view, Redis shared by every replica, speculative entries."""
