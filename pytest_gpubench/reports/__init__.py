"""Everything rendered from results: terminal, Markdown, HTML, history, exports, JUnit."""
