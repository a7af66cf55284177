"""What the plugin's tests share: stand-ins, proxies, real servers and the fixtures that start them."""
