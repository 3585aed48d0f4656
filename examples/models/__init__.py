"""Your project's own models package (tfpar never imports a package of this name)."""
