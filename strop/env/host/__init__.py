"""The host side of sandboxes, below every other sub-package: the account a sandbox's user runs as
(`account`), the node cache of images, repositories and downloads (`node_cache`), and the scratch
directories worlds live in while open (`scratch`)."""
