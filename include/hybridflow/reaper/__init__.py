"""The resource reaper: finds what the product created and nobody owns any more (gangs whose run
ended, serving versions nobody routes to, credentials Secrets of finished gangs, abandoned multipart
uploads, scratch folders of finished runs) and releases it, or lists it in dry-run."""
