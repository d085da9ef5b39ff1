"""The plugins bundled with plugserve, registered through entry points like any other."""
