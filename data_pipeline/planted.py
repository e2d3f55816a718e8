"""A planted-junk corpus: junk documents of the kinds web-scale corpora hold, built around real text, to
measure what the filters catch (recall per class) next to what they wrongly remove from clean text.

Every class is generated with randomised structure and lengths, so that no fixed threshold is tuned
to one layout: foreign-language text (Latin-script European languages, Cyrillic, Greek, Arabic,
Korean, Japanese, and English inside a Chinese source), lorem ipsum, HTML pages, numeric CSV, base64
blobs, letter soup (zh: also the characters of real text in random order), SEO keyword lists, URL lists, a sentence repeated inline, and minified
JavaScript. `planted_documents(real, n, seed)` returns (language, class, text) triples; `real` maps
"en" and "zh" to lists of clean documents that the generators borrow sentences and words from.
"""
from __future__ import annotations

import base64
import random
import re
import string

# A few sentences of ordinary prose per language (written for this purpose; several topics each so
# that the documents built from them are not near-duplicates of each other).
FOREIGN = {
    "fr": ["Le village se trouve au bord d'une rivière qui descend lentement vers la mer.",
           "Au début du siècle dernier, la plupart des habitants travaillaient dans les champs.",
           "La bibliothèque municipale a été reconstruite après l'incendie de mille neuf cent douze.",
           "Les enfants allaient à l'école à pied, même lorsque la neige couvrait les chemins.",
           "Selon les historiens, le château appartenait à une famille de marchands de drap.",
           "On y cultive encore la vigne, mais les récoltes sont moins abondantes qu'autrefois.",
           "Le conseil a décidé de construire un nouveau pont pour relier les deux quartiers.",
           "Chaque été, une fête réunit les familles sur la place principale devant l'église.",
           "Il faut environ deux heures de train pour rejoindre la capitale depuis la gare.",
           "Les chercheurs ont mesuré la température de l'eau pendant plusieurs années."],
    "de": ["Das Dorf liegt am Ufer eines Flusses, der langsam in Richtung Meer fließt.",
           "Im neunzehnten Jahrhundert arbeiteten die meisten Einwohner in der Landwirtschaft.",
           "Die Kirche wurde nach dem großen Brand im Jahr siebzehnhundert neu aufgebaut.",
           "Die Kinder gingen jeden Morgen zu Fuß zur Schule, auch wenn es stark schneite.",
           "Nach Angaben der Gemeinde leben heute etwa dreitausend Menschen in dem Ort.",
           "Der Bahnhof wurde erst nach dem Krieg wieder an das Netz angeschlossen.",
           "Seine Forschung beschäftigte sich vor allem mit der Geschichte der Handelsstädte.",
           "Im Sommer findet auf dem Marktplatz ein Fest statt, zu dem viele Besucher kommen.",
           "Die Brücke über den Fluss musste wegen des Hochwassers gesperrt werden.",
           "Es dauert ungefähr zwei Stunden, mit dem Zug in die Hauptstadt zu fahren."],
    "es": ["El pueblo se encuentra a orillas de un río que baja lentamente hacia el mar.",
           "A principios del siglo pasado, la mayoría de los vecinos trabajaba en el campo.",
           "La iglesia fue reconstruida después del gran incendio que destruyó el centro.",
           "Los niños caminaban hasta la escuela todas las mañanas, incluso cuando llovía.",
           "Según los historiadores, el castillo perteneció a una familia de comerciantes.",
           "Todavía se cultivan olivos, aunque las cosechas son menores que antes.",
           "El ayuntamiento decidió construir un puente nuevo para unir los dos barrios.",
           "Cada verano se celebra una fiesta en la plaza mayor frente al ayuntamiento.",
           "Se tarda unas dos horas en tren para llegar a la capital desde la estación.",
           "Los investigadores midieron la temperatura del agua durante varios años."],
    "pt": ["A aldeia fica na margem de um rio que desce devagar em direção ao mar.",
           "No início do século passado, quase todos os moradores trabalhavam na lavoura.",
           "A igreja foi reconstruída depois do grande incêndio que destruiu o centro.",
           "As crianças iam a pé para a escola todas as manhãs, mesmo quando chovia muito.",
           "Segundo os historiadores, o castelo pertenceu a uma família de comerciantes.",
           "Ainda se cultivam oliveiras, embora as colheitas sejam menores do que antes.",
           "A câmara decidiu construir uma ponte nova para ligar os dois bairros.",
           "Todos os verões há uma festa na praça principal em frente à igreja.",
           "Leva cerca de duas horas de comboio para chegar à capital a partir da estação.",
           "Os investigadores mediram a temperatura da água durante vários anos."],
    "it": ["Il paese si trova sulla riva di un fiume che scende lentamente verso il mare.",
           "All'inizio del secolo scorso quasi tutti gli abitanti lavoravano nei campi.",
           "La chiesa fu ricostruita dopo il grande incendio che distrusse il centro.",
           "I bambini andavano a scuola a piedi ogni mattina, anche quando pioveva.",
           "Secondo gli storici, il castello apparteneva a una famiglia di mercanti.",
           "Si coltivano ancora gli ulivi, anche se i raccolti sono più scarsi di un tempo.",
           "Il comune ha deciso di costruire un nuovo ponte per unire i due quartieri.",
           "Ogni estate si tiene una festa nella piazza principale davanti alla chiesa.",
           "Ci vogliono circa due ore di treno per raggiungere la capitale dalla stazione.",
           "I ricercatori hanno misurato la temperatura dell'acqua per diversi anni."],
    "nl": ["Het dorp ligt aan de oever van een rivier die langzaam naar de zee stroomt.",
           "Aan het begin van de vorige eeuw werkten de meeste inwoners op het land.",
           "De kerk werd herbouwd na de grote brand die het centrum had verwoest.",
           "De kinderen liepen elke ochtend naar school, ook als het hard regende.",
           "Volgens historici was het kasteel eigendom van een familie van handelaren.",
           "Er worden nog steeds appels geteeld, al zijn de oogsten kleiner dan vroeger.",
           "De gemeente besloot een nieuwe brug te bouwen tussen de twee wijken.",
           "Elke zomer is er een feest op het marktplein voor de kerk.",
           "Het duurt ongeveer twee uur met de trein om de hoofdstad te bereiken.",
           "De onderzoekers hebben jarenlang de temperatuur van het water gemeten."],
    "ru": ["Деревня расположена на берегу реки, которая медленно течёт к морю.",
           "В начале прошлого века большинство жителей работали в поле.",
           "Церковь была восстановлена после большого пожара, уничтожившего центр.",
           "Дети каждое утро ходили в школу пешком, даже когда шёл сильный снег.",
           "По словам историков, замок принадлежал семье богатых купцов.",
           "Здесь до сих пор выращивают яблоки, хотя урожаи стали меньше, чем раньше.",
           "Городской совет решил построить новый мост между двумя районами.",
           "Каждое лето на главной площади проходит праздник, собирающий много гостей.",
           "До столицы можно доехать на поезде примерно за два часа.",
           "Исследователи несколько лет измеряли температуру воды в озере."],
    "el": ["Το χωριό βρίσκεται στην όχθη ενός ποταμού που κυλά αργά προς τη θάλασσα.",
           "Στις αρχές του περασμένου αιώνα οι περισσότεροι κάτοικοι δούλευαν στα χωράφια.",
           "Η εκκλησία ξαναχτίστηκε μετά τη μεγάλη πυρκαγιά που κατέστρεψε το κέντρο.",
           "Τα παιδιά πήγαιναν κάθε πρωί με τα πόδια στο σχολείο, ακόμη κι όταν έβρεχε.",
           "Σύμφωνα με τους ιστορικούς, το κάστρο ανήκε σε μια οικογένεια εμπόρων.",
           "Εδώ καλλιεργούνται ακόμη ελιές, αν και η σοδειά είναι μικρότερη από παλιά.",
           "Το δημοτικό συμβούλιο αποφάσισε να χτίσει μια νέα γέφυρα ανάμεσα στις δύο συνοικίες.",
           "Κάθε καλοκαίρι γίνεται γιορτή στην κεντρική πλατεία μπροστά στην εκκλησία.",
           "Χρειάζονται περίπου δύο ώρες με το τρένο για να φτάσει κανείς στην πρωτεύουσα.",
           "Οι ερευνητές μέτρησαν τη θερμοκρασία του νερού για αρκετά χρόνια."],
    "ar": ["تقع القرية على ضفة نهر يجري ببطء نحو البحر.",
           "في بداية القرن الماضي كان معظم السكان يعملون في الزراعة.",
           "أعيد بناء المسجد بعد الحريق الكبير الذي دمر وسط المدينة.",
           "كان الأطفال يذهبون إلى المدرسة سيرا على الأقدام كل صباح حتى في أيام المطر.",
           "بحسب المؤرخين كانت القلعة ملكا لعائلة من التجار الأغنياء.",
           "ما زال السكان يزرعون الزيتون رغم أن المحصول أصبح أقل من قبل.",
           "قرر المجلس البلدي بناء جسر جديد يربط بين الحيين.",
           "يقام كل صيف احتفال كبير في الساحة الرئيسية أمام السوق القديم.",
           "يستغرق الوصول إلى العاصمة بالقطار نحو ساعتين من المحطة.",
           "قام الباحثون بقياس درجة حرارة الماء لعدة سنوات متتالية."],
    "ko": ["이 마을은 바다를 향해 천천히 흐르는 강가에 자리 잡고 있다.",
           "지난 세기 초에는 대부분의 주민이 논과 밭에서 일했다.",
           "교회는 도심을 태운 큰 화재 이후에 다시 지어졌다.",
           "아이들은 비가 많이 오는 날에도 매일 아침 걸어서 학교에 갔다.",
           "역사학자들에 따르면 그 성은 부유한 상인 가문의 소유였다.",
           "지금도 사과를 재배하지만 수확량은 예전보다 많이 줄었다.",
           "시의회는 두 지역을 잇는 새 다리를 짓기로 결정했다.",
           "매년 여름 중앙 광장에서는 많은 사람이 모이는 축제가 열린다.",
           "기차를 타면 역에서 수도까지 두 시간 정도 걸린다.",
           "연구자들은 몇 년 동안 호수의 물 온도를 측정했다."],
    "ja": ["この村は、海に向かってゆっくり流れる川のほとりにある。",
           "前世紀の初めには、住民のほとんどが田畑で働いていた。",
           "教会は町の中心を焼いた大火事のあとに建て直された。",
           "子どもたちは雨の日でも毎朝歩いて学校に通っていた。",
           "歴史家によると、その城は裕福な商人の一族のものだった。",
           "今でもりんごが栽培されているが、収穫は昔より少なくなった。",
           "市議会は二つの地区を結ぶ新しい橋を造ることを決めた。",
           "毎年夏になると、中央の広場で多くの人が集まる祭りが開かれる。",
           "駅から首都までは電車でおよそ二時間かかる。",
           "研究者たちは数年にわたって湖の水温を測定した。"],
}
FOREIGN_IN = {"en": ("fr", "de", "es", "pt", "it", "nl", "ru", "el", "ar", "ko", "ja"),
              "zh": ("ko", "ja", "ru", "en")}  # "en" in a Chinese source: real English sentences

LOREM = ("lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor incididunt ut labore "
         "et dolore magna aliqua enim ad minim veniam quis nostrud exercitation ullamco laboris nisi aliquip "
         "ex ea commodo consequat duis aute irure in reprehenderit voluptate velit esse cillum fugiat nulla "
         "pariatur excepteur sint occaecat cupidatat non proident sunt culpa qui officia deserunt mollit anim "
         "id est laborum curabitur pretium tincidunt lacus nunc pulvinar sapien eget mi proin sed libero "
         "vestibulum morbi blandit cursus risus viverra maecenas accumsan lacus vel facilisis").split()

CLASSES = ("foreign", "lorem_ipsum", "html", "numeric_csv", "base64", "letter_soup", "seo_keywords",
           "url_list", "repeated_sentence", "minified_js")


def _sentences(real_docs: list[str], language: str, rng: random.Random, n: int) -> list[str]:
    """n sentences of real text (from random documents)."""
    out = []
    pat = r"[^。！？]+[。！？]" if language == "zh" else r"[A-Z][^.!?\n]{30,300}[.!?]"
    while len(out) < n:
        doc = rng.choice(real_docs)
        start = rng.randrange(max(1, len(doc) - 3000))
        found = re.findall(pat, doc[start:start + 3000])
        found = [s.strip() for s in found if 8 <= len(s.strip()) <= 300]
        if found:
            out.append(rng.choice(found))
    return out


def _paragraphs(real_docs, language, rng, n_par, per_par=(2, 5)) -> list[str]:
    joiner = "" if language == "zh" else " "
    return [joiner.join(_sentences(real_docs, language, rng, rng.randint(*per_par))) for _ in range(n_par)]


def _words(real_docs, language, rng, n) -> list[str]:
    """n distinct-ish words (en) or 2-4 character strings (zh) taken from real text."""
    out = []
    while len(out) < n:
        s = _sentences(real_docs, language, rng, 1)[0]
        if language == "zh":
            han = re.findall(r"[\u4e00-\u9fff]{2,4}", s)
            out.extend(han[:3])
        else:
            out.extend(w.lower() for w in re.findall(r"[A-Za-z]{4,12}", s)[:3])
    return out[:n]


def foreign(real, language, rng):
    lang = rng.choice(FOREIGN_IN[language])
    if lang == "en":
        sents = _sentences(real["en"], "en", rng, rng.randint(3, 12))
    else:  # each sentence at most once: a document of 3 to 10 different sentences
        sents = rng.sample(FOREIGN[lang], rng.randint(3, len(FOREIGN[lang])))
    joiner = "" if lang == "ja" else " "
    pars, i = [], 0
    while i < len(sents):
        k = rng.randint(1, 4)
        pars.append(joiner.join(sents[i:i + k]))
        i += k
    title = sents[0][:rng.randint(8, 30)].strip()
    return "\n\n".join([title] + pars) if rng.random() < 0.7 else "\n\n".join(pars)


def lorem_ipsum(real, language, rng):
    pars = []
    for p in range(rng.randint(1, 8)):
        sents = []
        for _ in range(rng.randint(2, 8)):
            words = [rng.choice(LOREM) for _ in range(rng.randint(5, 18))]
            sents.append(" ".join(words).capitalize() + rng.choice(".!?." if rng.random() < 0.2 else "."))
        pars.append(" ".join(sents))
    if rng.random() < 0.6:
        pars[0] = "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " + pars[0]
    if rng.random() < 0.3:  # a template page: a real heading over placeholder text
        pars.insert(0, _sentences(real[language], language, rng, 1)[0][:60])
    return "\n\n".join(pars)


def html(real, language, rng):
    pars = _paragraphs(real[language], language, rng, rng.randint(1, 5))
    title = _sentences(real[language], language, rng, 1)[0][:50]
    nav = "".join(f'<li class="nav-item"><a href="/{w}/index.html" title="{w}">{w}</a></li>'
                  for w in _words(real[language], language, rng, rng.randint(3, 12)))
    body = "\n".join(f'<p class="{rng.choice(["lead", "text", "c" + str(rng.randint(1, 99))])}">{p}</p>'
                     if rng.random() < 0.7 else f"<div><span>{p}</span><br/></div>" for p in pars)
    style = ("<style>body{margin:0;padding:0;font-family:Arial,sans-serif}.nav-item{display:inline-block;"
             "padding:4px 8px}#main{max-width:960px;margin:0 auto}</style>") if rng.random() < 0.6 else ""
    script = ('<script type="text/javascript">window.dataLayer=window.dataLayer||[];function gtag(){'
              'dataLayer.push(arguments)}gtag("js",new Date());</script>') if rng.random() < 0.5 else ""
    table = ""
    if rng.random() < 0.4:
        rows = "".join(f"<tr><td>{w}</td><td>{rng.randint(1, 999)}</td></tr>"
                       for w in _words(real[language], language, rng, rng.randint(3, 10)))
        table = f'<table class="data"><tbody>{rows}</tbody></table>'
    parts = [f'<!DOCTYPE html>\n<html lang="{language}">\n<head>\n<meta charset="utf-8">\n<title>{title}</title>',
             style, script, '</head>\n<body>\n<div id="header"><ul class="nav">' + nav + "</ul></div>",
             '<div id="main">', body, table, '</div>\n<div id="footer">&copy; 2014 <a href="/about">About</a>'
             ' | <a href="/contact">Contact</a></div>\n</body>\n</html>']
    return "\n".join(p for p in parts if p)


def numeric_csv(real, language, rng):
    cols = rng.randint(3, 12)
    sep = rng.choice([",", ";", "\t", "|", ", "])
    header = sep.join(rng.choice(["id", "date", "value", "x", "y", "price", "qty", "lat", "lon", "score",
                                  "year", "count", "min", "max", "mean", "日期", "数量"]) + str(i)
                      for i in range(cols))
    lines = [header] if rng.random() < 0.7 else []
    for r in range(rng.randint(15, 150)):
        row = []
        for c in range(cols):
            kind = rng.random()
            if kind < 0.4:
                row.append(str(rng.randint(0, 10 ** rng.randint(1, 7))))
            elif kind < 0.75:
                row.append(f"{rng.uniform(-1000, 1000):.{rng.randint(1, 6)}f}")
            elif kind < 0.9:
                row.append(f"{rng.randint(1990, 2024)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}")
            else:
                row.append(f"{rng.randint(0, 99999):05d}")
        lines.append(sep.join(row))
    return "\n".join(lines)


def base64_blob(real, language, rng):
    raw = rng.randbytes(rng.randint(300, 6000))
    b = base64.b64encode(raw).decode()
    if rng.random() < 0.5:
        b = "\n".join(b[i:i + 76] for i in range(0, len(b), 76))
    prefix = rng.choice(["", "data:image/png;base64,", "-----BEGIN CERTIFICATE-----\n", "attachment: "])
    return prefix + b


def letter_soup(real, language, rng):
    kind = rng.random()
    if language == "zh" and kind < 0.8:
        n = rng.randint(100, 2000)
        if kind < 0.4:  # characters of the CJK Unified Ideographs block
            chars = [chr(rng.randint(0x4E00, 0x9FA5)) for _ in range(n)]
        else:  # characters of real text (as frequent as there) in random order
            pool = re.findall(r"[\u4e00-\u9fff]", "".join(_sentences(real[language], language, rng, 40)))
            chars = [rng.choice(pool) for _ in range(n)]
        for i in range(0, len(chars), rng.randint(10, 40)):
            chars[i] = rng.choice("，。 \n")
        return "".join(chars)
    letters = string.ascii_lowercase if rng.random() < 0.6 else string.ascii_letters
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(1, 11))) for _ in range(rng.randint(60, 600))]
    text, line = [], []
    for w in words:
        line.append(w)
        if rng.random() < 0.08:
            text.append(" ".join(line) + rng.choice(["", ".", ","]))
            line = []
    text.append(" ".join(line))
    return "\n".join(text) if rng.random() < 0.5 else " ".join(text)


def seo_keywords(real, language, rng):
    heads = _words(real[language], language, rng, rng.randint(1, 4))
    mods_en = ["best", "cheap", "buy", "online", "sale", "free shipping", "near me", "review", "2024", "top 10",
               "discount", "official", "price", "deals", "for men", "for women", "store", "wholesale", "new"]
    mods_zh = ["最新", "便宜", "正品", "包邮", "价格", "推荐", "官网", "下载", "排行榜", "2024", "免费", "批发",
               "哪家好", "多少钱", "图片", "大全", "促销"]
    mods = mods_zh if language == "zh" else mods_en
    extra = _words(real[language], language, rng, rng.randint(5, 30))
    phrases = []
    for _ in range(rng.randint(30, 200)):
        words = [rng.choice(heads)] + [rng.choice(mods) for _ in range(rng.randint(0, 2))]
        if rng.random() < 0.3:
            words.append(rng.choice(extra))
        rng.shuffle(words)
        phrases.append(("" if language == "zh" and rng.random() < 0.5 else " ").join(words))
    sep = rng.choice([", ", " | ", "\n", " - ", "，", " "]) if language == "zh" else rng.choice(
        [", ", " | ", "\n", " - ", " ", "; "])
    return sep.join(phrases)


def url_list(real, language, rng):
    words = [w for w in _words(real["en"], "en", rng, 40)]
    tlds = ["com", "org", "net", "cn", "info", "co.uk", "de", "io"]
    lines = []
    for _ in range(rng.randint(10, 120)):
        host = f"{rng.choice(['www.', '', 'm.', 'blog.'])}{rng.choice(words)}{rng.choice(['', '-' + rng.choice(words)])}.{rng.choice(tlds)}"
        path = "/".join(rng.choice(words) for _ in range(rng.randint(0, 4)))
        url = f"{rng.choice(['http', 'https'])}://{host}/{path}"
        if rng.random() < 0.4:
            url += f"?id={rng.randint(1, 99999)}&ref={rng.choice(words)}"
        if rng.random() < 0.3:
            url = f"{rng.choice(words).title()} {rng.choice(words)} - {url}"
        lines.append(url)
    return "\n".join(lines) if rng.random() < 0.8 else " ".join(lines)


def repeated_sentence(real, language, rng):
    s = _sentences(real[language], language, rng, 1)[0]
    times = rng.randint(10, 40)
    joiner = "" if language == "zh" else " "
    text = joiner.join([s] * times)
    if rng.random() < 0.3:  # after a short real lead
        text = _sentences(real[language], language, rng, 1)[0] + joiner + text
    return text


def minified_js(real, language, rng):
    ident = lambda: rng.choice(string.ascii_letters + "_$") + "".join(
        rng.choice(string.ascii_letters + string.digits) for _ in range(rng.randint(0, 2)))
    parts = ['!function(e,t){"use strict";']
    words = _words(real["en"], "en", rng, 20)
    for _ in range(rng.randint(20, 200)):
        a, b, c = ident(), ident(), ident()
        kind = rng.random()
        if kind < 0.3:
            parts.append(f"function {a}({b},{c}){{return {b}&&{c}?{b}.{rng.choice(words)}({c}):null}}")
        elif kind < 0.55:
            parts.append(f"var {a}={{{rng.choice(words)}:{rng.randint(0, 999)},{rng.choice(words)}:\"{rng.choice(words)}\"}};")
        elif kind < 0.8:
            parts.append(f"for(var {a}=0;{a}<{b}.length;{a}++){{{c}[{a}]={b}[{a}]*{rng.randint(2, 9)};}}")
        else:
            parts.append(f"{a}.prototype.{rng.choice(words)}=function({b}){{this.{c}={b}||{{}};return this}};")
    parts.append("}(window,document);")
    text = "".join(parts)
    if rng.random() < 0.3:
        cut = sorted(rng.sample(range(len(text)), 3))
        text = "\n".join([text[:cut[0]], text[cut[0]:cut[1]], text[cut[1]:]])
    return text


GENERATORS = {"foreign": foreign, "lorem_ipsum": lorem_ipsum, "html": html, "numeric_csv": numeric_csv,
              "base64": base64_blob, "letter_soup": letter_soup, "seo_keywords": seo_keywords,
              "url_list": url_list, "repeated_sentence": repeated_sentence, "minified_js": minified_js}


def planted_documents(real: dict[str, list[str]], n_per_class: int, seed: int = 0,
                      classes: tuple[str, ...] = CLASSES) -> list[tuple[str, str, str]]:
    """(language of the source it is planted in, class, text): n_per_class documents of each class for
    each language in `real` (real["en"] is needed for every language: URLs and JavaScript identifiers
    are English words, and English is the foreign text planted in Chinese sources)."""
    rng = random.Random(seed)
    out = []
    for language in real:
        for cls in classes:
            for _ in range(n_per_class):
                out.append((language, cls, GENERATORS[cls](real, language, rng)))
    return out
