"""ImageFolder trees by their public path, `shmloader.imagefolder.convert_images(...)`
(tools/imagefolder.py)."""

from .tools.imagefolder import check_images, convert_images, list_images

__all__ = ["check_images", "convert_images", "list_images"]
