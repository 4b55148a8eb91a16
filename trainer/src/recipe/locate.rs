//! Finding things in a recipe's text, so errors can say where: the line of a field given its
//! path (`grpo.optimizer.lr`, `rewards.components[2].weight`), and the path of the field at a
//! line and column (for errors the RON parser reports by position only).
//!
//! A small lexer over RON (identifiers, strings, raw strings, characters, numbers, comments,
//! brackets, `:` and `,`) is enough: both questions are about nesting, never about values.

#[derive(Clone, Debug, PartialEq)]
enum Kind {
    Ident(String),
    Open(char),
    Close,
    Colon,
    Comma,
    Other,
}

#[derive(Clone, Debug)]
struct Token {
    kind: Kind,
    line: usize,
    col: usize,
}

fn lex(text: &str) -> Vec<Token> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let (mut i, mut line, mut col) = (0usize, 1usize, 1usize);
    // Advances over `n` characters, keeping line and column.
    let advance = |i: &mut usize, line: &mut usize, col: &mut usize, n: usize| {
        for _ in 0..n {
            if *i < chars.len() {
                if chars[*i] == '\n' {
                    *line += 1;
                    *col = 1;
                } else {
                    *col += 1;
                }
                *i += 1;
            }
        }
    };
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        let (tl, tc) = (line, col);
        if c.is_whitespace() {
            advance(&mut i, &mut line, &mut col, 1);
        } else if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                advance(&mut i, &mut line, &mut col, 1);
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0usize;
            loop {
                if i >= chars.len() {
                    break;
                }
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    advance(&mut i, &mut line, &mut col, 2);
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    advance(&mut i, &mut line, &mut col, 2);
                    if depth == 0 {
                        break;
                    }
                } else {
                    advance(&mut i, &mut line, &mut col, 1);
                }
            }
        } else if c == '"' || c == '\'' {
            advance(&mut i, &mut line, &mut col, 1);
            while i < chars.len() && chars[i] != c {
                let n = if chars[i] == '\\' { 2 } else { 1 };
                advance(&mut i, &mut line, &mut col, n);
            }
            advance(&mut i, &mut line, &mut col, 1);
            out.push(Token {
                kind: Kind::Other,
                line: tl,
                col: tc,
            });
        } else if c == 'r' && matches!(next, Some('"') | Some('#')) {
            // A raw string: r"…", r#"…"#, …
            let mut hashes = 0;
            let mut j = i + 1;
            while chars.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if chars.get(j) == Some(&'"') {
                let n = j + 1 - i;
                advance(&mut i, &mut line, &mut col, n);
                loop {
                    if i >= chars.len() {
                        break;
                    }
                    if chars[i] == '"' && (1..=hashes).all(|k| chars.get(i + k) == Some(&'#')) {
                        advance(&mut i, &mut line, &mut col, 1 + hashes);
                        break;
                    }
                    advance(&mut i, &mut line, &mut col, 1);
                }
                out.push(Token {
                    kind: Kind::Other,
                    line: tl,
                    col: tc,
                });
            } else {
                advance(&mut i, &mut line, &mut col, 1);
                out.push(Token {
                    kind: Kind::Ident("r".into()),
                    line: tl,
                    col: tc,
                });
            }
        } else if c.is_alphabetic() || c == '_' {
            let mut name = String::new();
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                name.push(chars[i]);
                advance(&mut i, &mut line, &mut col, 1);
            }
            out.push(Token {
                kind: Kind::Ident(name),
                line: tl,
                col: tc,
            });
        } else {
            let kind = match c {
                '(' | '[' | '{' => Kind::Open(c),
                ')' | ']' | '}' => Kind::Close,
                ':' => Kind::Colon,
                ',' => Kind::Comma,
                _ => Kind::Other,
            };
            if kind == Kind::Other {
                // Numbers, `#![enable(…)]`'s `#!`, signs: one token up to a delimiter.
                while i < chars.len()
                    && !chars[i].is_whitespace()
                    && !"()[]{}:,\"'".contains(chars[i])
                {
                    advance(&mut i, &mut line, &mut col, 1);
                }
            } else {
                advance(&mut i, &mut line, &mut col, 1);
            }
            out.push(Token {
                kind,
                line: tl,
                col: tc,
            });
        }
    }
    out
}

#[derive(Clone, Debug, PartialEq)]
enum Segment {
    Field(String),
    Index(usize),
}

fn segments(path: &str) -> Vec<Segment> {
    let mut out = Vec::new();
    for part in path.split('.') {
        let (name, rest) = match part.find('[') {
            Some(i) => (&part[..i], &part[i..]),
            None => (part, ""),
        };
        if !name.is_empty() {
            out.push(Segment::Field(name.to_string()));
        }
        for idx in rest.split('[').filter(|s| !s.is_empty()) {
            if let Ok(n) = idx.trim_end_matches(']').parse() {
                out.push(Segment::Index(n));
            }
        }
    }
    out
}

/// Index of the first token of the value starting at `i`, stepping into it: after an
/// identifier followed by an opener (`Some(`, `Lora(`), or after an opener. `None` when the
/// value is not a container.
fn enter(tokens: &[Token], i: usize) -> Option<usize> {
    let mut i = i;
    if matches!(tokens.get(i)?.kind, Kind::Ident(_))
        && matches!(tokens.get(i + 1).map(|t| &t.kind), Some(Kind::Open(_)))
    {
        i += 1;
    }
    matches!(tokens.get(i)?.kind, Kind::Open(_)).then_some(i + 1)
}

/// The tokens of the container whose contents start at `start`, at depth 0:
/// `(index, token)` pairs up to the matching close.
fn top_level(tokens: &[Token], start: usize) -> Vec<usize> {
    let mut depth = 0usize;
    let mut out = Vec::new();
    for (i, t) in tokens.iter().enumerate().skip(start) {
        match t.kind {
            Kind::Open(_) => {
                if depth == 0 {
                    out.push(i);
                }
                depth += 1;
            }
            Kind::Close => {
                if depth == 0 {
                    break;
                }
                depth -= 1;
            }
            _ => {
                if depth == 0 {
                    out.push(i);
                }
            }
        }
    }
    out
}

fn find_field(tokens: &[Token], start: usize, name: &str) -> Option<usize> {
    let top = top_level(tokens, start);
    for &i in &top {
        if tokens[i].kind == Kind::Ident(name.to_string())
            && tokens.get(i + 1).map(|t| &t.kind) == Some(&Kind::Colon)
        {
            return Some(i);
        }
    }
    // A wrapper holding one container (`Some((…))`, a newtype variant): look inside it.
    if top.len() <= 2 {
        let inner = enter(tokens, *top.first()?)?;
        return find_field(tokens, inner, name);
    }
    None
}

fn find_index(tokens: &[Token], start: usize, index: usize) -> Option<usize> {
    let top = top_level(tokens, start);
    let mut item = 0;
    let mut at_item_start = true;
    for &i in &top {
        if tokens[i].kind == Kind::Comma {
            item += 1;
            at_item_start = true;
        } else if at_item_start {
            if item == index {
                return Some(i);
            }
            at_item_start = false;
        }
    }
    None
}

/// The line of the field at `path` (dot-separated names, `[n]` for list items), or of the
/// deepest part of the path that exists.
pub fn line_of(text: &str, path: &str) -> Option<usize> {
    let tokens = lex(text);
    // The root value: `Recipe(…)` or `(…)`, after any `#![enable(…)]` attributes.
    let root = tokens.iter().enumerate().position(|(i, t)| {
        matches!(t.kind, Kind::Open('('))
            && !tokens[..i]
                .iter()
                .rev()
                .take(3)
                .any(|p| p.kind == Kind::Open('['))
    })?;
    let mut pos = root + 1;
    let mut line = None;
    let segs = segments(path);
    for (k, seg) in segs.iter().enumerate() {
        let value = match seg {
            Segment::Field(name) => {
                let i = find_field(&tokens, pos, name)?;
                line = Some(tokens[i].line);
                i + 2
            }
            Segment::Index(n) => match find_index(&tokens, pos, *n) {
                Some(i) => {
                    line = Some(tokens[i].line);
                    i
                }
                None => return line,
            },
        };
        if k + 1 < segs.len() {
            match enter(&tokens, value) {
                Some(p) => pos = p,
                None => return line,
            }
        }
    }
    line
}

/// Like [`line_of`], falling back to the deepest existing prefix of `path`.
pub fn best_line(text: &str, path: &str) -> Option<usize> {
    let mut p = path.to_string();
    loop {
        if let Some(l) = line_of(text, &p) {
            return Some(l);
        }
        match p.rfind(['.', '[']) {
            Some(i) => p.truncate(i),
            None => return None,
        }
    }
}

/// The path of the field being written at `line`:`col` (1-based), e.g. `grpo.optimizer.lr`
/// for a position inside `lr`'s value, or `grpo.optimizer` at the position of a field name.
pub fn path_at(text: &str, line: usize, col: usize) -> String {
    #[derive(Debug)]
    struct Frame {
        list: bool,
        field: Option<String>,
        index: usize,
    }
    let tokens = lex(text);
    let mut stack: Vec<Frame> = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        if (t.line, t.col) >= (line, col) {
            break;
        }
        match &t.kind {
            Kind::Open(c) => stack.push(Frame {
                list: *c == '[',
                field: None,
                index: 0,
            }),
            Kind::Close => {
                stack.pop();
            }
            Kind::Comma => {
                if let Some(f) = stack.last_mut() {
                    if f.list {
                        f.index += 1;
                    } else {
                        f.field = None;
                    }
                }
            }
            Kind::Ident(name) => {
                if tokens.get(i + 1).map(|t| &t.kind) == Some(&Kind::Colon)
                    && let Some(f) = stack.last_mut()
                    && !f.list
                {
                    f.field = Some(name.clone());
                }
            }
            _ => {}
        }
    }
    let mut out = String::new();
    for f in &stack {
        if f.list {
            out.push_str(&format!("[{}]", f.index));
        } else if let Some(name) = &f.field {
            if !out.is_empty() {
                out.push('.');
            }
            out.push_str(name);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"// a recipe
#![enable(implicit_some)]
Recipe(
    name: "x (not a bracket: [)",
    grpo: (
        steps: 3, /* inline (comment) */
        optimizer: (lr: 1e-6,
            betas: (0.9, 0.99)),
    ),
    sft: Some((
        steps: 2,
    )),
    model: (tuning: Lora(rank: 8, targets: [q_proj, k_proj])),
    rewards: (components: [
        FormatGate(weight: 0.1),
        TokenBudget(
            weight: -0.15,
        ),
    ]),
)
"#;

    #[test]
    fn lines_of_paths() {
        assert_eq!(line_of(TEXT, "grpo"), Some(5));
        assert_eq!(line_of(TEXT, "grpo.steps"), Some(6));
        assert_eq!(line_of(TEXT, "grpo.optimizer.lr"), Some(7));
        assert_eq!(line_of(TEXT, "grpo.optimizer.betas"), Some(8));
        assert_eq!(line_of(TEXT, "sft.steps"), Some(11));
        assert_eq!(line_of(TEXT, "model.tuning.rank"), Some(13));
        assert_eq!(line_of(TEXT, "rewards.components[1].weight"), Some(17));
        assert_eq!(line_of(TEXT, "rewards.components[1]"), Some(16));
        assert_eq!(line_of(TEXT, "grpo.nothing"), None);
        assert_eq!(best_line(TEXT, "grpo.optimizer.nothing"), Some(7));
        assert_eq!(best_line(TEXT, "nothing"), None);
    }

    #[test]
    fn paths_at_positions() {
        // Inside lr's value (line 7, column 25 is `1e-6`).
        let col = TEXT.lines().nth(6).unwrap().find("1e-6").unwrap() + 1;
        assert_eq!(path_at(TEXT, 7, col), "grpo.optimizer.lr");
        // At the name of a field: the container.
        let col = TEXT.lines().nth(6).unwrap().find("lr").unwrap() + 1;
        assert_eq!(path_at(TEXT, 7, col), "grpo.optimizer");
        let col = TEXT.lines().nth(16).unwrap().find("-0.15").unwrap() + 1;
        assert_eq!(path_at(TEXT, 17, col), "rewards.components[1].weight");
        assert_eq!(path_at(TEXT, 11, 16), "sft.steps");
    }
}
