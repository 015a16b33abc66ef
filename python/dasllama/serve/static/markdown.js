// A small markdown renderer for model replies. Safe by construction: the text is HTML-escaped
// first, and the only markup added is what the patterns below write (links only to http(s)).
// Unclosed code fences render as code, so a reply still streaming looks right.
"use strict";

(function (global) {
  function esc(s) {
    return s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;").replace(/'/g, "&#39;");
  }

  // `s` is escaped already. Code spans and links are set aside first so that emphasis never
  // reaches into them (a URL's underscores stay underscores).
  function inline(s) {
    const held = [];
    const hold = (html) => "\u0000" + (held.push(html) - 1) + "\u0000";
    s = s.replace(/`([^`\n]+)`/g, (_, code) => hold("<code>" + code + "</code>"));
    s = s.replace(/\[([^\]\n]+)\]\((https?:\/\/[^\s()<>]+)\)/g, (_, text, url) => hold('<a href="' + url + '" target="_blank" rel="noopener noreferrer">' + text + "</a>"));
    s = s.replace(/\*\*(?=\S)([^*\n]*?\S)\*\*/g, "<strong>$1</strong>");
    s = s.replace(/__(?=\S)([^_\n]*?\S)__/g, "<strong>$1</strong>");
    s = s.replace(/(^|[^*\w])\*(?=\S)([^*\n]*?\S)\*(?![*\w])/g, "$1<em>$2</em>");
    s = s.replace(/(^|[^_\w])_(?=\S)([^_\n]*?\S)_(?![_\w])/g, "$1<em>$2</em>");
    s = s.replace(/~~(?=\S)([^~\n]*?\S)~~/g, "<del>$1</del>");
    return s.replace(/\u0000(\d+)\u0000/g, (_, i) => held[+i]);
  }

  const FENCE = /^\s*(`{3,}|~{3,})\s*([\w+#.-]*)\s*$/;
  const HEADING = /^(#{1,6})\s+(.*?)\s*#*\s*$/;
  const RULE = /^\s*([-*_])(\s*\1){2,}\s*$/;
  const QUOTE = /^\s*>\s?/;
  const UL = /^\s*[-*+]\s+/;
  const OL = /^\s*(\d+)[.)]\s+/;
  const TABLE_SEP = /^\s*\|?\s*:?-{1,}:?\s*(\|\s*:?-{1,}:?\s*)*\|?\s*$/;

  function isBlockStart(line) {
    return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || UL.test(line) || OL.test(line);
  }

  function cells(line) {
    return line.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((c) => inline(esc(c.trim())));
  }

  function render(src) {
    const lines = String(src).replace(/\r\n?/g, "\n").replace(/\u0000/g, "").split("\n");
    const out = [];
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      const fence = line.match(FENCE);
      if (fence) {
        const marker = fence[1];
        const lang = fence[2];
        const body = [];
        i++;
        while (i < lines.length && !lines[i].trim().startsWith(marker)) body.push(lines[i++]);
        i++;
        const cls = lang ? ' class="language-' + esc(lang) + '"' : "";
        const label = lang ? '<span class="lang">' + esc(lang) + "</span>" : "";
        out.push('<pre class="code">' + label + "<code" + cls + ">" + esc(body.join("\n")) + "</code></pre>");
        continue;
      }
      if (!line.trim()) {
        i++;
        continue;
      }
      const h = line.match(HEADING);
      if (h) {
        const n = h[1].length;
        out.push("<h" + n + ">" + inline(esc(h[2])) + "</h" + n + ">");
        i++;
        continue;
      }
      if (RULE.test(line)) {
        out.push("<hr>");
        i++;
        continue;
      }
      if (QUOTE.test(line)) {
        const inner = [];
        while (i < lines.length && QUOTE.test(lines[i])) inner.push(lines[i++].replace(QUOTE, ""));
        out.push("<blockquote>" + render(inner.join("\n")) + "</blockquote>");
        continue;
      }
      if (UL.test(line) || OL.test(line)) {
        const ordered = !UL.test(line);
        const re = ordered ? OL : UL;
        const first = ordered ? +line.match(OL)[1] : 1;
        const items = [];
        while (i < lines.length && re.test(lines[i])) {
          let item = lines[i++].replace(re, "");
          // Indented lines continue the item (nested lists are shown flat).
          while (i < lines.length && /^\s{2,}\S/.test(lines[i]) && !re.test(lines[i])) item += "\n" + lines[i++].trim();
          items.push("<li>" + item.split("\n").map((l) => inline(esc(l))).join("<br>") + "</li>");
        }
        const tag = ordered ? "ol" : "ul";
        out.push("<" + tag + (ordered && first !== 1 ? ' start="' + first + '"' : "") + ">" + items.join("") + "</" + tag + ">");
        continue;
      }
      if (line.includes("|") && i + 1 < lines.length && TABLE_SEP.test(lines[i + 1]) && lines[i + 1].includes("-")) {
        const head = cells(line);
        i += 2;
        const rows = [];
        while (i < lines.length && lines[i].includes("|") && lines[i].trim()) rows.push(cells(lines[i++]));
        out.push(
          "<table><thead><tr>" + head.map((c) => "<th>" + c + "</th>").join("") + "</tr></thead><tbody>" +
            rows.map((r) => "<tr>" + r.map((c) => "<td>" + c + "</td>").join("") + "</tr>").join("") + "</tbody></table>"
        );
        continue;
      }
      const para = [line];
      i++;
      while (i < lines.length && lines[i].trim() && !isBlockStart(lines[i])) para.push(lines[i++]);
      out.push("<p>" + para.map((l) => inline(esc(l))).join("<br>") + "</p>");
    }
    return out.join("\n");
  }

  global.renderMarkdown = render;
  global.escapeHtml = esc;
})(window);
